"""Multi-process serving (pocketjax/serve/distributed.py): real 2-process jobs on 127.0.0.1 over JAX's gloo CPU
collectives, each process running tests/multihost_worker.py, compared with the same requests in this one process.

Each job compiles its steps in both children, so the module takes a minute or two on a busy 2-core box; the jobs
share one compilation cache folder so the later ones load what the first compiled.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import pocketjax as pj
from multihost_worker import LOGITS_PROMPT, MAX_TOKENS, PROMPTS
from pocketjax.errors import ConfigError, DistributedError
from pocketjax.serve import distributed

WORKER = Path(__file__).with_name("multihost_worker.py")
CHECKPOINT = "qwen3_gqa4_headdim"  # 8 query heads over 2 kv heads: tp=2 splits both
JOB_TIMEOUT_S = 240
JAX_ABORT = "Terminating process because the JAX distributed service detected fatal errors"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_job(scenario: str, checkpoint: Path, out: Path, *, tp: int, dp: int, devices: int,
              cache: Path) -> list[subprocess.Popen]:
    """Two worker processes of one job, each with `devices` CPU devices."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
    coordinator = f"127.0.0.1:{free_port()}"
    return [subprocess.Popen([sys.executable, str(WORKER), scenario, "--coordinator", coordinator,
                              "--num-processes", "2", "--process-id", str(i), "--checkpoint", str(checkpoint),
                              "--tp", str(tp), "--dp", str(dp), "--out", str(out), "--compile-cache-dir", str(cache)],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for i in range(2)]


def finish(procs: list[subprocess.Popen], timeout: float = JOB_TIMEOUT_S) -> tuple[list[int], list[str], list[float]]:
    """Each process's exit status, stderr and exit time; kills the job (and fails the test) past `timeout`."""
    deadline = time.monotonic() + timeout
    codes, errs, ended = [], [], []
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            logs = "\n".join((q.communicate()[1] or "")[-2000:] for q in procs)
            pytest.fail(f"the job did not end within {timeout} s (a hang):\n{logs}")
        codes.append(p.returncode)
        errs.append(err)
        ended.append(time.time())
    return codes, errs, ended


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("multihost_xla")


@pytest.fixture(scope="module")
def reference(hf_checkpoint) -> dict:
    return one_process(hf_checkpoint(CHECKPOINT))


def one_process(folder: Path) -> dict:
    """The worker's requests run in this one process, on one device."""
    model = pj.load_model(folder)
    logits = np.asarray(pj.logits(model, LOGITS_PROMPT))
    with pj.LLM(model, max_batch_size=1, max_seq_len=256) as llm:
        outs = llm.generate(PROMPTS, pj.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2))
    return {"logits": logits, "tokens": [o.token_ids for o in outs],
            "logprobs": [[lp for lp, _ in o.logprobs] for o in outs]}


@pytest.mark.parametrize("tp, dp", [(2, 1), (1, 2)], ids=["tp2-across", "dp2-across"])
def test_two_processes_match_one(tp, dp, hf_checkpoint, reference, compile_cache, tmp_path):
    """tp=2 split over the two processes, and dp=2 replicas one per process (one CPU device each): every process
    returns the greedy tokens, logprobs and logits of one process, and a request that process 0 cancels ends
    "cancelled" on both, after the same tokens. New weights (`update_params` on every process) are served from
    the same step everywhere: what follows answers as a fresh LLM on them in the same job."""
    assert_job_matches(hf_checkpoint(CHECKPOINT), reference, tp, dp, compile_cache, tmp_path)


@pytest.mark.leg2_only  # a 2-process job compiled in both children (~1-2 min): the shorter leg runs it
def test_a_moe_model_split_over_two_processes_matches_one(moe_checkpoint, compile_cache, tmp_path):
    """Issue 68: a qwen3_moe job with tp=2 across the two processes (each expert split over them: sharding.py) answers
    what one process does, and serves new weights from the same step on both."""
    folder = moe_checkpoint("qwen3_moe")
    assert_job_matches(folder, one_process(folder), 2, 1, compile_cache, tmp_path)


def assert_job_matches(checkpoint: Path, reference: dict, tp: int, dp: int, compile_cache: Path,
                       tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    codes, errs, _ = finish(start_job("generate", checkpoint, out, tp=tp, dp=dp, devices=1, cache=compile_cache))
    assert codes == [0, 0], "\n".join(e[-3000:] for e in errs)
    results = [json.loads(Path(f"{out}.{i}").read_text()) for i in range(2)]
    for r in results:
        assert len(r["devices"]) == tp * dp and {d.split(":")[0] for d in r["devices"]} == {"cpu"}
        assert r["tokens"] == reference["tokens"]
        assert r["finish"] == ["length"] * len(PROMPTS)
        np.testing.assert_allclose(r["logprobs"], reference["logprobs"], atol=2e-5)
        np.testing.assert_allclose(np.array(r["logits"]), reference["logits"], atol=2e-5)
        assert r["cancelled"]["finish_reason"] == "cancelled"
        assert 3 <= len(r["cancelled"]["tokens"]) < 200
        assert r["exchanges"] > 0  # the followers really followed process 0's broadcasts
        assert_updates_served(r, reference["tokens"])
    for key in ("cancelled", "exchanges", "after_update", "same_step", "finished_running", "held", "fresh"):
        assert results[0][key] == results[1][key], key


def assert_updates_served(r: dict, loaded: list[list[int]]) -> None:
    """One process's view of the worker's updates (multihost_worker.updated_by_hand): `loaded` are the greedy tokens
    of the loaded weights, r["fresh"] those of a fresh LLM on the new ones."""
    assert r["fresh"] != loaded  # the new weights answer differently: every check below can fail
    assert r["after_update"] == r["fresh"]  # LLM.update_params, process 1 calling it late
    assert r["same_step"] == loaded  # the update back, broadcast in the same step as these requests
    assert r["finished_running"] == loaded[0]  # finish_running: it ended on the old weights...
    assert r["held"] == r["fresh"]  # ...and the requests queued meanwhile waited for the new ones


def test_dead_follower_fails_the_leader_fast(hf_checkpoint, compile_cache, tmp_path):
    """Process 1 dies abruptly mid-generation: process 0's request fails with DistributedError within seconds
    (the broken connection), instead of hanging."""
    out = tmp_path / "out.json"
    codes, errs, _ = finish(start_job("die-1", hf_checkpoint(CHECKPOINT), out, tp=2, dp=1, devices=1,
                                      cache=compile_cache))
    assert codes[1] == 17, errs[1][-3000:]
    died = json.loads(Path(f"{out}.1").read_text())["died_at"]
    leader = json.loads(Path(f"{out}.0").read_text())
    assert leader.get("error") == "DistributedError", (leader, errs[0][-3000:])
    assert "lost contact" in leader["message"] or "stay in step" in leader["message"]
    assert leader["at"] - died < 10


def test_dead_leader_ends_the_follower(hf_checkpoint, compile_cache, tmp_path):
    """Process 0 (the coordinator) dies abruptly while process 1 follows it: process 1 ends within seconds with a
    clear error, ours (DistributedError) or JAX's own distributed client terminating it, never a hang."""
    out = tmp_path / "out.json"
    codes, errs, ended = finish(start_job("die-0", hf_checkpoint(CHECKPOINT), out, tp=2, dp=1, devices=1,
                                          cache=compile_cache))
    assert codes[0] == 17, errs[0][-3000:]
    died = json.loads(Path(f"{out}.0").read_text())["died_at"]
    follower = Path(f"{out}.1")
    if follower.exists():  # it raised before JAX's client terminated it
        assert json.loads(follower.read_text()).get("error") == "DistributedError"
    else:
        assert codes[1] != 0 and JAX_ABORT in errs[1], errs[1][-3000:]
    assert ended[1] - died < 20


def test_initialize_arguments_and_environment():
    """Nothing set: a single-process run. Half a job's settings: ConfigError naming what is missing (before JAX
    is touched)."""
    assert distributed.initialize(environ={}) is False
    assert distributed.initialize(num_processes=1, environ={}) is False
    with pytest.raises(ConfigError, match="coordinator"):
        distributed.initialize(environ={"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"})
    with pytest.raises(ConfigError, match="process_id must be in"):
        distributed.initialize("127.0.0.1:1234", 2, 2, environ={})
    with pytest.raises(ConfigError, match="JAX_PROCESS_ID must be an integer"):
        distributed.initialize(environ={"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2",
                                        "JAX_PROCESS_ID": "one"})
    assert distributed.ProcessGroup.current() is None  # this pytest process is not part of a job
    assert issubclass(DistributedError, pj.errors.StoppedError)


def test_cli_flags_reach_the_job_setup(capsys):
    """`--num-processes` without the rest is refused with the typed error's one-line message, exit status 2."""
    from pocketjax.serve.cli import main

    assert main(["generate", "hi", "--num-processes", "2", "--process-id", "1"]) == 2
    assert "ConfigError" in capsys.readouterr().err


def test_exchange_roundtrips_messages_inline_and_overflowing():
    """The wire format alone, through JAX's own single-process broadcast: empty news, news inside the 1 KiB header,
    and news too long for it (a long prompt), which takes the second, power-of-two-sized broadcast."""
    group = distributed.ProcessGroup(0, 1)
    short = {"add": [["req-0", [1, 2, 3], {"max_tokens": 4, "stop": ["\n"]}]], "cancel": ["req-9"]}
    long = {"add": [["req-1", list(range(3000)), {"temperature": 0.5}]]}
    assert group.exchange({}) == {}
    assert group.exchange(short) == short
    assert group.exchange(long) == long
    assert group.exchanges == 3
    assert group.bytes == len(json.dumps(short, separators=(",", ":"))) + len(json.dumps(long, separators=(",", ":")))
    assert group.bytes > distributed.HEADER_BYTES  # the long one really overflowed the header
