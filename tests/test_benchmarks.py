"""benchmarks/bench_engine.py end to end on the tiny preset at minimal sizes: the JSON schema, never the timings; and
benchmarks/common.py, what the scripts share."""
import argparse
import importlib.util
import json
import platform
import subprocess
import sys

import numpy as np
import pytest

from types import SimpleNamespace

from benchmarks import bench_engine, common, roofline
from benchmarks.peers import launch
from benchmarks.presets import PRESETS, build_preset, gguf_tensor_name, preset_config, write_gguf
from pocketjax.model import cpu_kernels
from pocketjax.model.checkpoint import expected_shapes, open_checkpoint
from pocketjax.model.config import DTYPES, ModelConfig

pytestmark = pytest.mark.leg1_only  # the scripts on CPU; the GPU host runs its own in leg 2 (device_check --dry-run)

RECORD_KEYS = {"system", "dtype", "concurrency", "prefill_tok_s", "decode_tok_s", "decode_ratio_vs_c1",
               "pct_bandwidth_roofline", "pct_matmul_peak", "decode_step_ms"}
CHECK_KEYS = {"batched_vs_minimal_ratio", "minimal_loop_ms_per_token", "engine_c1_ms_per_token",
              "doubled_max_seq_len_ratio", "doubled_max_seq_len_step_ms", "minimal_loop_tokens_match"}
BREAKDOWN_KEYS = {"forward_ms", "lm_head_ms", "layers_ms", "sampler_ms", "host_ms"}
# The transformers peer where torch is installed; CI's torch-free leg benchmarks pocketjax alone.
PEERS = ["transformers"] if importlib.util.find_spec("torch") and importlib.util.find_spec("transformers") else []


@pytest.mark.timeout(300)
def test_run_benchmark_writes_records_json_plot_and_table_last(tmp_path, capsys):
    # One concurrency: each one costs ~4 XLA compiles (~15 s on 2 busy cores), whatever the model's size.
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    # vLLM under an interpreter that fails at once: its row says why, every other row stays
    crashing = fake_interpreter(tmp_path, "echo 'vllm: cannot start here' >&2; exit 3")
    result = bench_engine.run_benchmark(quick=True, model="qwen3-micro", cache_dir=str(tmp_path / "models"),
                                        concurrency="1", prompt_len=8, gen_len=3, repeats=1,
                                        peers=",".join(PEERS + ["vllm"]), vllm_python=str(crashing),
                                        json=str(out), plot=str(png))
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert png.stat().st_size > 0
    machine = result["machine"]
    assert {"cpu", "cores", "jax", "torch", "peaks", "loadavg_start", "loadavg_end", "cpu_family", "cpu_model",
            "isa_flags", "cpu_kernels"} <= set(machine)
    kernels = machine["cpu_kernels"]  # the code paths of the native kernels this run measured (None: not built)
    assert kernels is None or set(kernels) == {"float32_weight", "bfloat16_weight"}
    assert machine["peaks"]["bandwidth_bytes_s"] > 0 and machine["peaks"]["matmul_flop_s"] > 0
    records, (skipped,) = result["records"][:-1], result["records"][-1:]
    assert skipped == {"system": "vllm", "dtype": "float32", "skipped": "exit code 3: vllm: cannot start here",
                       "phase_read_bytes_s": skipped["phase_read_bytes_s"]}
    assert [(r["system"], r["concurrency"]) for r in records] == [("pocketjax", 1)] + [(p, 1) for p in PEERS]
    for r in records[1:]:  # the peers' own processes measure their memory
        assert r["peak_rss_mb"] > 0
    for r in records:
        assert RECORD_KEYS <= set(r), RECORD_KEYS - set(r)
        assert r["dtype"] == "float32" and r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0
    c1 = records[0]
    assert c1["decode_ratio_vs_c1"] == 1.0
    assert CHECK_KEYS <= set(c1) and BREAKDOWN_KEYS <= set(c1)
    assert c1["minimal_loop_tokens_match"] is True  # greedy: the engine and the minimal loop agree
    lines = [line for line in capsys.readouterr().out.strip().splitlines()]
    table = lines[-(len(records) + 3):]
    assert table[0].startswith("| system |") and all(line.startswith("| ") for line in table[2:])
    assert table[-1].startswith("| vllm | float32 | - | skipped: exit code 3: vllm: cannot start here |")
    assert table[-1].count("|") == table[0].count("|")


def test_cpu_features_lists_only_flags_the_cpu_reports():
    try:
        lines = open("/proc/cpuinfo").read().splitlines()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    flags = set(next((line.split(":", 1)[1] for line in lines if line.startswith(("flags", "Features"))), "").split())
    features = bench_engine.cpu_features()
    assert set(features["isa_flags"]) == flags & set(bench_engine.ISA_FLAGS)


def test_quick_fills_only_what_was_not_given():
    args = bench_engine.resolve_args(quick=True, gen_len=5)
    assert (args.model, args.gen_len, args.prompt_len) == ("qwen3-tiny", 5, bench_engine.QUICK["prompt_len"])
    assert args.concurrency == [1, 4] and args.peers == ["transformers"]
    assert args.max_seq_len == 128
    assert bench_engine.resolve_args(peers="", prompt_len=200, gen_len=64).max_seq_len == 512
    assert bench_engine.resolve_args(peers="").peers == []
    assert bench_engine.resolve_args(peers="vllm,llamacpp").peers == ["vllm", "llamacpp"]
    with pytest.raises(SystemExit):
        bench_engine.resolve_args(peers="ollama")
    with pytest.raises(SystemExit):
        bench_engine.resolve_args(gguf_types="q3_k")
    assert bench_engine.resolve_args(quantize="int4").gguf_types == ["float32", "q4_0", "q4_k_m"]


def test_decode_bytes_count_every_weight_once_plus_each_sequences_kv():
    config = ModelConfig.from_dict(preset_config("qwen3-0.6b"))
    weights = roofline.weight_bytes_per_step(config, "bfloat16", batch=1)
    assert weights == 2 * config.num_params()  # tied: the lm_head is the embedding, read once
    assert 1.1e9 < weights < 1.3e9  # Qwen3-0.6B: 596M parameters
    per_token = roofline.kv_bytes_per_token(config, "bfloat16")
    assert per_token == 2 * 28 * 8 * 128 * 2
    assert roofline.decode_bytes(config, "bfloat16", 4, 100) == weights + 4 * 100 * per_token
    flops = roofline.prefill_flops(config, 1, 1)
    assert flops == 2 * 28 * roofline.layer_matmul_params(config) + 2 * 1024 * 151936 + 4 * 28 * 16 * 128


def test_moe_decode_bytes_are_the_active_experts_at_one_row_and_their_union_beyond():
    """Issue 68: one token reads its top_k experts (the active parameters), a batch the union of its rows' experts,
    and a batch routed everywhere every expert; FLOPs count the active experts only."""
    config = ModelConfig.from_dict(preset_config("qwen3-moe"))
    moe, h, v = config.moe, config.hidden_size, config.vocab_size
    untied_embedding = v * h - h  # one looked-up row read, not the table
    assert roofline.weight_bytes_per_step(config, "bfloat16", 1) == 2 * (config.num_params(active=True)
                                                                         - untied_embedding)
    per_expert = 3 * h * moe.intermediate_size * config.num_layers
    at8 = roofline.weight_bytes_per_step(config, "bfloat16", 8) / 2 - config.num_params(active=True) + v * h - 8 * h
    assert at8 == pytest.approx(per_expert * (128 * (1 - (120 / 128) ** 8) - 8))  # ~51.6 experts of 128
    everything = roofline.weight_bytes_per_step(config, "bfloat16", 10_000) / 2 + v * h - 10_000 * h
    assert everything == pytest.approx(config.num_params())
    dense = ModelConfig.from_dict(preset_config("qwen3-moe-dense"))  # the same active parameters per token
    assert roofline.layer_matmul_params(config) == roofline.layer_matmul_params(dense) + moe.num_experts * h


def test_roofline_fields_and_ratios_are_per_system():
    config = ModelConfig.from_dict(preset_config("qwen3-tiny"))
    args = SimpleNamespace(prompt_len=16, gen_len=8, dtype="float32")
    peaks = roofline.Peaks(10e9, 10e9, 9e9, 5e9, 100e9, "float32", 1024, 1 << 20)
    records = [{"system": s, "dtype": "float32", "concurrency": c, "prefill_tok_s": 100.0 * c, "decode_tok_s": v,
                "phase_read_bytes_s": bw}
               for s, c, v, bw in (("pocketjax", 1, 10.0, 10e9), ("pocketjax", 2, 30.0, 10e9),
                                   ("transformers", 1, 5.0, 20e9), ("transformers", 2, 6.0, 20e9))]
    bench_engine.add_roofline(records, config, args, peaks)
    assert [r["decode_ratio_vs_c1"] for r in records] == [1.0, 3.0, 1.0, 1.2]
    assert records[3]["pocketjax_decode_speedup"] == 5.0
    assert records[3]["pocketjax_decode_speedup_equal_bandwidth"] == pytest.approx(10.0)  # the peer had 2x the bandwidth
    assert records[0]["pct_phase_bandwidth"] == pytest.approx(100 * records[0]["achieved_decode_gb_s"] * 1e9 / 10e9)
    bound = peaks.bandwidth_bytes_s / roofline.decode_bytes(config, "float32", 1, 16 + 8 / 2)
    assert records[0]["pct_bandwidth_roofline"] == pytest.approx(100 * 10.0 / bound)
    assert "| transformers | float32 | 2 |" in bench_engine.markdown_table(records)


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3-0.6b"])
def test_every_checkpoint_tensor_has_a_distinct_gguf_name(name):
    for overrides in ({}, {"attention_bias": True, "tie_word_embeddings": False}):
        shapes = expected_shapes(ModelConfig.from_dict({**preset_config(name), **overrides}))
        names = {gguf_tensor_name(n) for n in shapes}
        assert len(names) == len(shapes)
    assert gguf_tensor_name("model.layers.3.self_attn.k_norm.weight") == "blk.3.attn_k_norm.weight"
    assert gguf_tensor_name("lm_head.weight") == "output.weight"


def test_command_line_options_given_explicitly_survive_quick():
    parse = bench_engine.build_parser(suppress_defaults=True).parse_args
    given = vars(parse(["--quick", "--model", "qwen3-0.6b", "--concurrency", "1,2,4,8", "--no-checks"]))
    args = bench_engine.resolve_args(given)
    assert (args.model, args.concurrency, args.checks) == ("qwen3-0.6b", [1, 2, 4, 8], False)
    assert args.prompt_len == bench_engine.QUICK["prompt_len"]
    full = bench_engine.resolve_args(bench_engine.build_parser().parse_args(["--gen-len", "9"]))
    assert (full.gen_len, full.model, full.checks) == (9, "qwen3-0.6b", True)


def test_shared_options_keep_their_types_and_quick_fills_only_defaults():
    quick = dict(model="qwen3-micro", prompt_len=8, concurrency="1")
    p = common.add_quick(common.add_options(argparse.ArgumentParser(), model="qwen3-tiny", dtype="float32",
                                            concurrency="1,4", prompt_len=32, header_timeout=3.0, json=None), quick)
    assert common.parse(p, []) == dict(model="qwen3-tiny", dtype="float32", concurrency="1,4", prompt_len=32,
                                       header_timeout=3.0, json=None, quick=False)
    args = common.parse(p, ["--quick", "--prompt-len", "5", "--header-timeout", "0.5"], quick)
    assert [args[k] for k in ("model", "prompt_len", "concurrency", "header_timeout")] == ["qwen3-micro", 5, "1", 0.5]
    with pytest.raises(SystemExit):
        p.parse_args(["--dtype", "float64"])
    assert common.DTYPES == DTYPES  # the --dtype choices are the dtypes load_model takes
    assert common.parse_ints("1, 4,,8") == [1, 4, 8] and common.parse_ints("") == []


def test_machine_record_json_file_and_markdown_table(tmp_path):
    info = common.machine(*common.FIELDS, cores=3, run="x")
    assert list(info) == [*common.FIELDS, "run"] and info["cores"] == 3  # a field given keeps its place
    assert json.loads(json.dumps(info)) == info
    common.write_json(None, info)  # no --json: nothing written
    out = tmp_path / "new" / "folder" / "result.json"
    common.write_json(out, {"machine": info, "path": tmp_path})
    assert json.loads(out.read_text()) == {"machine": info, "path": str(tmp_path)}
    table = common.markdown_table(["a", "b"], [[1, "x"], [2.5, None]])
    assert table == "| a | b |\n|---|---|\n| 1 | x |\n| 2.5 | None |"
    with pytest.raises(SystemExit, match="neither a preset"):
        common.model_folder(str(tmp_path / "nothing-here"))



def fake_interpreter(folder, body: str):
    """An executable standing in for a peer's python: it gets `-m MODULE --json-in SPEC --json-out OUT` ($6 = OUT)."""
    path = folder / "fake-python"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return path


def test_a_crashing_or_hanging_peer_leaves_a_skipped_row_and_keeps_its_rows(tmp_path):
    spec = {"checkpoint": str(tmp_path), "dtype": "float32", "kind": "q4_0", "concurrency": [1, 2]}
    row = {"system": "llamacpp", "dtype": "float32", "quantize": "q4_0", "concurrency": 1, "prefill_tok_s": 9.0,
           "decode_tok_s": 2.0}
    segfault = fake_interpreter(tmp_path, f"echo '{json.dumps({'records': [row]})}' > $6; "
                                          "echo 'ggml_repack: AMX' >&2; kill -SEGV $$")
    rows = launch.run_peer(str(segfault), "llamacpp", spec, timeout=30)
    assert rows == [row, {"system": "llamacpp", "dtype": "q4_0", "skipped": "killed by SIGSEGV: ggml_repack: AMX"}]
    hang = fake_interpreter(tmp_path, "sleep 30 & wait")  # a child of its own: the whole group is ended
    assert launch.run_peer(str(hang), "vllm", spec, timeout=0.5)[-1]["skipped"] == "timed out after 0.5 s"
    missing = launch.run_peer(str(tmp_path / "no-such-python"), "vllm", spec, timeout=30)
    assert missing[0]["skipped"].startswith("could not start")
    table = bench_engine.markdown_table(rows + missing)
    assert "| llamacpp | q4_0 | - | skipped: killed by SIGSEGV: ggml_repack: AMX |" in table


def test_each_gguf_type_is_its_own_peer_process_and_peers_import_no_jax(tmp_path):
    args = bench_engine.resolve_args(peers="llamacpp,vllm", gguf_types="float32,q4_k_m", threads=3)
    specs = bench_engine.peer_specs("llamacpp", tmp_path, args)
    assert [s["kind"] for s in specs] == ["float32", "q4_k_m"] and {s["threads"] for s in specs} == {3}
    assert bench_engine.peer_specs("vllm", tmp_path, args)[0]["kind"] == "float32"
    # vLLM's venv has neither jax nor pocketjax: the peers' modules import neither
    code = ("import sys, benchmarks.peers.launch, benchmarks.peers.vllm_peer, benchmarks.peers.llamacpp_peer, "
            "benchmarks.peers.transformers_peer, benchmarks.peers.vllm_server; "
            "assert not {'jax', 'pocketjax', 'torch'} & set(sys.modules), sys.modules.keys()")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=launch.ROOT)


def test_weight_read_reads_every_matrix_a_decode_step_multiplies():
    """The probe's shapes are the checkpoint's 2-D weights (norms aside), the tied embedding read once as the head."""
    from benchmarks.weight_read import step_shapes

    config = ModelConfig.from_dict(preset_config("qwen3-0.6b"))
    matrices = [shape for name, shape in expected_shapes(config).items() if len(shape) == 2]
    assert sorted(step_shapes(PRESETS["qwen3-0.6b"])) == sorted(matrices)


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="an x86-64 (AVX2) probe")
def test_weight_read_quick_run_times_each_form(tmp_path):
    from benchmarks import weight_read

    out = tmp_path / "w.json"
    weight_read.main(["--quick", "--json", str(out)])
    result = json.loads(out.read_text())
    forms = {(r["form"], r["dtype"]) for r in result["records"]}
    assert forms == {("read", "float32"), ("kernel", "float32"), ("read", "bfloat16"), ("kernel", "bfloat16"),
                     ("evenodd", "bfloat16")}
    gb = {r["dtype"]: r["GB"] for r in result["records"]}
    assert gb["float32"] == pytest.approx(2 * gb["bfloat16"])  # the same shapes at 4 and 2 bytes
    assert all(r["median_ms"] > 0 for r in result["records"]) and len(result["ratios"]) == 4


@pytest.mark.skipif(not cpu_kernels.available(), reason="tiles are the native kernel's layout")
def test_bench_tiles_quick_run_times_both_layouts_on_the_same_tokens(tmp_path, capsys):
    """bench_tiles steps a tiled and a row-major engine alternately (it raises if their greedy tokens differ) and
    records both medians per concurrency; the table is printed last."""
    from benchmarks import bench_tiles

    out = tmp_path / "tiles.json"
    bench_tiles.main(["--quick", "--cache-dir", str(tmp_path / "models"), "--json", str(out)])
    records = json.loads(out.read_text())["records"]
    assert [r["concurrency"] for r in records] == [1, 2]
    assert all(r["row_major_ms"] > 0 and r["tiled_ms"] > 0 and r["steps_each"] == 8 for r in records)
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("| qwen3-micro | int4+head8 | 2 |")


@pytest.mark.skipif(not cpu_kernels.available(), reason="row streams are the native kernel's block order")
def test_bench_streams_quick_run_times_both_row_orders_on_the_same_bits(tmp_path, capsys):
    """bench_streams runs one decode step's products in adjacent-row and row-stream blocks alternately (it raises if
    their outputs differ) and records both medians per weight form and row count, the table printed last; --engine
    times an engine's decode step in a fresh process per order."""
    from benchmarks import bench_streams

    out = tmp_path / "streams.json"
    bench_streams.main(["--quick", "--rows", "1,3", "--json", str(out)])
    records = json.loads(out.read_text())["records"]
    assert [(r["weights"], r["rows"]) for r in records] == [("float32", 1), ("float32", 3), ("int8", 1), ("int8", 3)]
    assert all(r["adjacent_ms"] > 0 and r["streams_ms"] > 0 and r["products"] == 4 * 7 + 1 for r in records)
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("| qwen3-tiny | int8 | 3 |")
    bench_streams.main(["--engine", "--quick", "--cache-dir", str(tmp_path / "models"), "--json", str(out)])
    (record,) = json.loads(out.read_text())["records"]  # one fresh engine process per order
    assert (record["quantize"], record["concurrency"]) == ("int8+head", 2)
    assert all(len(record["runs"][order]) == 1 and record["runs"][order][0] > 0 for order in ("adjacent", "streams"))


@pytest.mark.skipif(not cpu_kernels.available(), reason="kernel_ab times versions of the native kernel")
def test_kernel_ab_times_each_version_in_one_process_on_its_own_kernel(tmp_path, capsys):
    """kernel_ab compiles a kernel version beside this tree's and runs each round's programs back to back: the
    tree's own source gives its bits and a record per weight form and row count; a version whose sums differ (its
    float32 outputs doubled) is refused unless --bits-may-differ, which shows each program calls its own kernel; the
    same for the attention kernel (`--weights attention`, a file named attention.cc)."""
    from benchmarks import kernel_ab

    out = tmp_path / "ab.json"
    kernel_ab.main(["--quick", "--variant", str(cpu_kernels.SOURCES[0]), "--json", str(out)])
    records = json.loads(out.read_text())["records"]
    assert [(r["weights"], r["rows"]) for r in records] == [("float32", 1), ("float32", 3), ("int8", 1), ("int8", 3)]
    name = str(cpu_kernels.SOURCES[0])
    assert all(len(r["times_s"][name]) == 3 and r["ms"]["tree"] > 0 and r["speedup"][name] > 0 for r in records)
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("| qwen3-tiny | int8 | 3 |")
    source = cpu_kernels.SOURCES[0].read_text()
    store = "static_cast<float*>(y)[r * N + n] = v;"
    assert store in source
    doubled = tmp_path / "doubled.cc"
    doubled.write_text(source.replace(store, "static_cast<float*>(y)[r * N + n] = 2.0f * v;"))
    with pytest.raises(RuntimeError, match="other bits"):
        kernel_ab.main(["--quick", "--weights", "float32", "--rows", "1", "--variant", str(doubled)])
    kernel_ab.main(["--quick", "--weights", "float32", "--rows", "1", "--variant", str(doubled), "--bits-may-differ"])
    attention = cpu_kernels.SOURCES[1].read_text()  # --weights attention: a variant of attention.cc alone
    store = "static_cast<float*>(p.out)[dst + j] = o;"
    assert store in attention
    broken = tmp_path / "attention.cc"
    broken.write_text(attention.replace(store, "static_cast<float*>(p.out)[dst + j] = 2.0f * o;"))
    kernel_ab.main(["--quick", "--weights", "attention", "--keys", "9", "--variant", str(cpu_kernels.SOURCES[1]),
                    "--json", str(out)])
    records = json.loads(out.read_text())["records"]
    assert [(r["weights"], r["rows"], r["calls"]) for r in records] == [("attention", 1, 4), ("attention", 3, 4)]
    with pytest.raises(RuntimeError, match="other bits"):
        kernel_ab.main(["--quick", "--weights", "attention", "--rows", "1", "--variant", str(broken)])


@pytest.mark.parametrize("name", ["qwen3-moe-micro", "qwen2-moe-micro"])
def test_a_moe_gguf_holds_each_layers_experts_stacked_as_llama_cpp_names_them(name, tmp_path):
    """Issue 68's llama.cpp peer: the router (float32), the experts stacked [E, out, in] in id order as ffn_*_exps
    (float32: the checkpoint's values; q8_0: gguf's own quantizer on that stack) and qwen2_moe's shared expert."""
    gguf = pytest.importorskip("gguf")
    folder = build_preset(name, tmp_path / name)
    checkpoint = open_checkpoint(folder)
    config = ModelConfig.from_folder(folder)
    for kind in ("float32", "q8_0"):
        reader = gguf.GGUFReader(write_gguf(folder, tmp_path / f"{kind}.gguf", kind))
        tensors = {t.name: t for t in reader.tensors}
        assert len(tensors) == len(checkpoint) - 3 * 2 * (config.moe.num_experts - 1)  # 3 stacks of E a layer
        assert int(reader.fields["%s.expert_count" % config.model_type.replace("_", "")].parts[-1][0]) == 8
        for layer in range(2):
            stack = np.stack([checkpoint[n].tensor(n) for n in
                              (f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight" for e in range(8))])
            down = tensors[f"blk.{layer}.ffn_down_exps.weight"]
            router = tensors[f"blk.{layer}.ffn_gate_inp.weight"]
            assert router.tensor_type == gguf.GGMLQuantizationType.F32
            expected = stack if kind == "float32" else gguf.quants.dequantize(
                gguf.quants.quantize(stack, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0)
            got = gguf.quants.dequantize(down.data, down.tensor_type).reshape(stack.shape)
            np.testing.assert_array_equal(got, expected)
        assert ("blk.1.ffn_gate_inp_shexp.weight" in tensors) == (name == "qwen2-moe-micro")
