#!/usr/bin/env bash
# Source trees for bench/ab_trees.sh, made here before the device call: .tbase from HEAD, and for
# each LABEL:PATCH a tree .tLABEL of HEAD with that patch applied (its docs/ left out; a patch that
# does not apply stops here, before any device time). Each tree holds what a build and the
# benchmark need (csrc mmha setup.py tests bench pyproject.toml). Prints the TREES string and the
# carry list (.tbase is excluded from git, so the call must carry it; the others travel as
# untracked files). Old .t* trees of these labels are replaced. PATCH may name several patches
# joined by "+", applied in that order (a tree of two changes together).
# Usage: bash bench/patch_trees.sh merge:docs/patches/a.diff wide:docs/patches/b.diff both:docs/patches/a.diff+docs/patches/b.diff
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PARTS=(csrc mmha setup.py tests bench pyproject.toml)
tree_of_head() {
  rm -rf "$1" && mkdir -p "$1"
  git archive HEAD "${PARTS[@]}" | tar -x -C "$1"
}
grep -qx '/.tbase/' .git/info/exclude 2>/dev/null || echo '/.tbase/' >>.git/info/exclude
tree_of_head .tbase
trees="base:.tbase"
for arg in "$@"; do
  label=${arg%%:*} patch=${arg#*:}
  IFS=+ read -r -a patches <<<"$patch"
  for f in "${patches[@]}"; do
    if [ "$label" = "$arg" ] || [ -z "$label" ] || [ ! -f "$f" ]; then
      echo "patch_trees.sh: $arg: give LABEL:PATCH with an existing patch file" >&2
      exit 2
    fi
  done
  if [ "$label" = base ]; then
    echo "patch_trees.sh: the label base is HEAD's tree" >&2
    exit 2
  fi
  tree_of_head ".t$label"
  for f in "${patches[@]}"; do
    if ! git apply --directory=".t$label" --exclude=".t$label/docs/*" "$f"; then
      echo "patch_trees.sh: $f does not apply to HEAD (tree $label)" >&2
      exit 1
    fi
  done
  trees="$trees $label:.t$label"
done
echo "TREES=\"$trees\""
echo "carry: [\".tbase\"]"
