#!/usr/bin/env bash
# Source trees for bench/ab_trees.sh, made here before the device call: .tbase from HEAD, and for
# each LABEL:PATCH a tree .tLABEL of HEAD with that patch applied (its docs/ left out; a patch that
# does not apply stops here, before any device time). Each tree holds what a build and the
# benchmark need (csrc mmha setup.py tests bench pyproject.toml). Prints the TREES string and the
# carry list (.tbase is excluded from git, so the call must carry it; the others travel as
# untracked files). Old .t* trees of these labels are replaced.
# Usage: bash bench/patch_trees.sh merge:docs/patches/lean_merges_put_off.diff wide:docs/patches/x.diff
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
  if [ "$label" = "$arg" ] || [ -z "$label" ] || [ ! -f "$patch" ]; then
    echo "patch_trees.sh: $arg: give LABEL:PATCH with an existing patch file" >&2
    exit 2
  fi
  if [ "$label" = base ]; then
    echo "patch_trees.sh: the label base is HEAD's tree" >&2
    exit 2
  fi
  tree_of_head ".t$label"
  if ! git apply --directory=".t$label" --exclude=".t$label/docs/*" "$patch"; then
    echo "patch_trees.sh: $patch does not apply to HEAD" >&2
    exit 1
  fi
  trees="$trees $label:.t$label"
done
echo "TREES=\"$trees\""
echo "carry: [\".tbase\"]"
