"""mmha.bench.kernel_times: kernel names, the per-kernel rows from the profiler's averages, the
refusal of bad arguments, and (GPU) a tree step's two launches."""

from types import SimpleNamespace

import pytest
from helpers import gpu

from mmha.bench import kernel_times as kt


@pytest.mark.parametrize(
    ("key", "name"),
    [
        ("void mmha::tree_prepare_kernel<__half, __half, 128>(mmha::MmhaParams)", "tree_prepare_kernel<__half, __half, 128>"),
        (
            "void mmha::decode_attention_kernel<__half, __half, 128, 64, (mmha::TileSource)2, false>(mmha::MmhaParams)",
            "decode_attention_kernel<__half, __half, 128, 64, (mmha::TileSource)2, false>",
        ),
        ("mmha::row_norm_kernel(float*, int)", "row_norm_kernel"),
    ],
)  # fmt: skip
def test_kernel_name(key, name):
    assert kt.kernel_name(key) == name


def test_per_kernel_keeps_mmha_kernels_per_step():
    events = [
        SimpleNamespace(key="void mmha::b_kernel<1>(mmha::MmhaParams)", count=50, device_time_total=1000.0),
        SimpleNamespace(key="void mmha::a_kernel<1>(mmha::MmhaParams)", count=100, device_time_total=500.0),
        SimpleNamespace(key="void mmha::c_kernel<1>(mmha::MmhaParams)", count=50, device_time_total=250.0),
        SimpleNamespace(key="void at::native::fill_kernel<float>(float*)", count=50, device_time_total=80.0),
        SimpleNamespace(key="mmha::op (cpu side)", count=50, device_time_total=0.0),
    ]
    rows = kt.per_kernel(events, calls=50)
    assert rows == [
        {"kernel": "a_kernel<1>", "per_step": 2.0, "us": 5.0},
        {"kernel": "b_kernel<1>", "per_step": 1.0, "us": 20.0},
        {"kernel": "c_kernel<1>", "per_step": 1.0, "us": 5.0},
    ]


@pytest.mark.parametrize(
    "argv", [["1,1024,65"], ["1,1024"], ["1,1024,64", "--calls", "0"], ["4,10,54", "--kv", "int8"]]
)
def test_bad_arguments_stop_before_anything_runs(argv):
    with pytest.raises(SystemExit) as e:
        kt.main(argv)
    assert e.value.code == 2


@gpu
def test_a_tree_step_shows_both_launches(capsys):
    r = kt.run_row("4,10,54", calls=3)
    launches = {k["kernel"].split("<")[0]: k for k in r["kernels"]}
    for name in ("tree_prepare_kernel", "decode_attention_kernel"):
        assert launches[name]["per_step"] == 1 and launches[name]["us"] > 0, r["kernels"]
    assert r["decode_us"] > 0
    print(kt.format_row(r))
    assert "tree 4,10,54 random" in capsys.readouterr().out
