"""The command line: demo (the README's main job) and show write their pictures and report sanely."""

import subprocess
import sys

import torch

import blockattn
from blockattn.bench import Row, markdown, ratios


def run_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "blockattn.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def test_demo_reports_error_density_timing_and_writes_the_picture(tmp_path):
    picture = tmp_path / "mask.png"
    result = run_cli("demo", "--seq", "640", "--heads", "2", "--dim", "32", "--block", "64x64", "--density", "0.3", "--dtype", "fp32",
                     "--repeats", "2", "--out", str(picture), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    for line in ("kept density", "relative error", "sparse attention", "dense SDPA", "speedup over dense"):
        assert line in result.stdout, result.stdout
    error = float(result.stdout.split("relative error")[1].split()[0])
    assert error < 1e-4
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_writes_its_table_json_and_plot(tmp_path):
    """`blockattn bench` on a small case: one table line per row (an error's message kept on its line), finite
    times for blockattn (and SDPA on the CPU, where the PyTorch backend, FlexAttention compiled for the CPU and
    PyTorch's SDPA are timed), and the plot."""
    import json
    on_gpu = torch.cuda.is_available()
    prefix = tmp_path / "bench"
    result = run_cli("bench", "--heads", "2", "--seq", "512", "--dim", "32", "--densities", "0.5", "--out",
                     str(prefix), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert ("no CUDA GPU here" in result.stdout) != on_gpu
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    sdpa = {("sdpa-cudnn", "fwd"), ("sdpa-flash", "fwd")} if on_gpu else {("sdpa", "fwd")}
    assert {(r["impl"], r["mode"]) for r in rows} >= {("blockattn", "fwd"), ("blockattn", "fwd+bwd"),
                                                      ("blockattn", "bwd"), ("flex", "fwd")} | sdpa
    for r in rows:
        if r["impl"] == "blockattn" or (r["impl"] == "sdpa" and not on_gpu):
            assert r["ms"] > 0 and r["tflops"] > 0, r
        assert "B1 H2 S512 D32" in r["case"]
    table = (tmp_path / "bench.md").read_text().strip().splitlines()[2:]  # past the environment line
    assert len(table) == 2 + len(rows) and all(line.startswith("| ") for line in table)
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_problem_sizes_follow_the_device():
    """demo and bench size what the caller leaves unset for the device, and keep what it sets."""
    import argparse

    from blockattn.cli import _problem_size
    unset = argparse.Namespace(seq=None, heads=None, dim=None, dtype=None)
    assert _problem_size(unset, torch.device("cpu")) == (4096, 4, 64, "fp32")
    assert _problem_size(unset, torch.device("cuda")) == (32768, 24, 128, "bf16")
    chosen = argparse.Namespace(seq=1000, heads=3, dim=16, dtype="fp16")
    assert _problem_size(chosen, torch.device("cpu")) == _problem_size(chosen, torch.device("cuda")) == (
        1000, 3, 16, "fp16")


def test_show_draws_each_pattern(tmp_path):
    for pattern in ("causal", "window", "global", "tile", "random"):
        picture = tmp_path / f"{pattern}.png"
        result = run_cli("show", pattern, "--seq", "1024", "--grid", "4,8,8", "--tile", "2,4,4", "--out",
                         str(picture), cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-2000:]
        assert picture.read_bytes()[:4] == b"\x89PNG" and "density" in result.stdout


def test_bench_table_puts_flex_ratio_beside_blockattn():
    rows = [Row("c", "blockattn", "fwd", 0.25, 2.0, 400.0), Row("c", "flex", "fwd", 0.25, 3.0, 300.0)]
    assert ratios(rows) == {("c", "fwd"): 1.5}
    assert "1.50x" in markdown(rows)
    failed = rows + [Row("c", "blockattn", "fwd+bwd", 0.25, 7.0, 400.0),
                     Row("c", "flex", "fwd+bwd", 0.25, float("nan"), float("nan"), "failed: NoValidChoicesError")]
    assert ratios(failed) == {("c", "fwd"): 1.5}, "a failed FlexAttention pass has no ratio"
    assert "nanx" not in markdown(failed)
    quantized = rows + [Row("c", "blockattn-int8", "fwd", 0.25, 1.5, 500.0)]
    assert ratios(quantized, "blockattn-int8") == {("c", "fwd"): 2.0} and ratios(quantized) == {("c", "fwd"): 1.5}
    assert "2.00x" in markdown(quantized) and "1.50x" in markdown(quantized)


def test_bench_quantized_runner_is_the_quantized_forward():
    """`blockattn bench --quant int8` adds a forward-only runner: attention(quant="int8") on the case's mask."""
    from blockattn.bench import Case, _inputs, _runners, block_mask

    case = Case(heads=2, kv_heads=2, seq=256, dim=32, block=(64, 64), density=0.5, dtype="fp32")
    device = torch.device("cpu")
    keep = block_mask(case, device)
    q, k, v = _inputs(case, device, requires_grad=False)
    runners = _runners(case, keep, device, quant="int8")
    fn, density = runners["blockattn-int8"]
    assert density == runners["blockattn"][1]
    want = blockattn.attention(q, k, v, keep, case.block, quant="int8")
    assert torch.equal(fn(q, k, v), want) and not torch.equal(want, runners["blockattn"][0](q, k, v))
    assert "blockattn-int8" not in _runners(case, keep, device)


def test_bench_causal_case_runs_the_same_attention_everywhere():
    """The causal benchmark case: every runner (blockattn with is_causal, FlexAttention with full and partial
    blocks, SDPA with is_causal) computes causal attention, and the full blocks are the ones needing no test."""
    import torch.nn.functional as F
    from blockattn.bench import Case, _inputs, _runners, block_mask, causal_blocks

    case = Case(heads=2, kv_heads=2, seq=300, dim=32, block=(64, 64), pattern="causal", density=0.5, dtype="fp32")
    device = torch.device("cpu")
    full, kept = causal_blocks(case, device, full=True), causal_blocks(case, device)
    assert (full <= kept).all() and not torch.equal(full, kept)
    assert torch.equal(block_mask(case, device)[0, 0], kept)
    q, k, v = _inputs(case, device, requires_grad=False)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    runners = _runners(case, block_mask(case, device), device)
    for name in ("blockattn", "flex"):
        fn, density = runners[name]
        assert not isinstance(fn, Exception), fn
        torch.testing.assert_close(fn(q, k, v), want, rtol=1e-4, atol=1e-5, msg=name)
        assert 0.5 < density < 0.7
