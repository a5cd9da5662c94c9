"""The `pipekit` command: plan's JSON, config checks before launch, and training runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipekit.cli import main
from pipekit.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_plan_json_gives_the_simulated_figures(capsys):
    assert main(["plan", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bubble_fraction"] == pytest.approx(3 / 11)
    assert report["makespan"] == pytest.approx(33)
    assert report["peak_activations"] == [4, 3, 2, 1]
    assert report["actions"][3][:4] == ["3F0", "3B0", "3F1", "3B1"]
    assert report["actions"][0][:5] == ["0F0", "0F1", "0F2", "0F3", "0B0"]


def test_plan_interleaved_and_text_timeline(capsys):
    assert main(["plan", "--schedule", "interleaved_1f1b", "--pp", "2", "--microbatches", "4", "--virtual", "2"]) == 0
    out = capsys.readouterr().out
    assert "bubble" in out and "makespan" in out


def test_plan_writes_trace_and_png(tmp_path, capsys):
    trace, png = tmp_path / "plan.json", tmp_path / "plan.png"
    assert main(["plan", "--schedule", "1f1b", "--pp", "2", "--microbatches", "3", "--json",
                 "--trace", str(trace), "--png", str(png)]) == 0
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["name"] for e in events if e["tid"] == 1) == ["1B0", "1B1", "1B2", "1F0", "1F1", "1F2"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_rejects_bad_input(capsys):
    assert main(["plan", "--schedule", "interleaved_1f1b", "--pp", "4", "--microbatches", "6", "--virtual", "2"]) == 2
    assert "multiple of pp=4, got 6" in capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.ppp=2"], "ppp"),
        (["parallel.pp=two"], "parallel.pp"),
        (["train.global_batch=30"],
         "train.global_batch=30 must equal train.micro_batch * schedule.microbatches * parallel.dp = 8 * 4 * 1 = 32"),
        (["schedule.name=zigzag"], "schedule.name='zigzag'"),
        (["parallel.pp=20"], "fewer than parallel.pp * chunks per rank = 20"),
        (["parallel.tp=3"], "model.vocab_size=64 is not divisible by parallel.tp=3"),
        (["model.hidden=5"], "model.hidden does not apply to the toy model"),
        (["train.dtype=float16"], "train.dtype='float16' is not one of"),
        (["schedule.name=interleaved_1f1b", "schedule.chunks_per_rank=2", "schedule.microbatches=3"],
         "multiple of pp=2, got 3"),
    ],
)
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("*", r"\*").replace(".", r"\.")):
        load_config(str(ROOT / "configs/toy.yaml"), overrides)


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_is_valid(path):
    cfg = load_config(str(path))
    assert cfg.world_size == cfg.parallel.pp * cfg.parallel.dp * cfg.parallel.tp


def test_model_config_errors_name_the_key():
    gpt2 = str(ROOT / "configs/gpt2_tiny.yaml")
    with pytest.raises(ConfigError, match=r"model.n_heads=4 is not divisible by parallel.tp=3"):
        load_config(gpt2, ["parallel.tp=3"])
    with pytest.raises(ConfigError, match=r"train.seq_len=256 exceeds model.max_seq_len=128"):
        load_config(gpt2, ["train.seq_len=256"])
    with pytest.raises(ConfigError, match=r"flavour"):
        load_config(gpt2, ["model.flavour=huge"])


def test_train_reports_bad_config_before_launching(capsys):
    assert main(["train", str(ROOT / "configs/toy.yaml"), "parallel.dp=2", "parallel.tp=3"]) == 2
    assert "not divisible by parallel.tp=3" in capsys.readouterr().err


def test_train_single_process(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", str(ROOT / "configs/toy.yaml"), "parallel.pp=1", "train.steps=40", "logging.log_every=20",
            "logging.progress=false", f"logging.out_dir={out}", "logging.trace_step=2"]
    assert main(args) == 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    summary = json.loads(lines[-1])["summary"]
    assert summary["final_loss"] < 0.5 * summary["first_loss"]
    assert summary["final_val_loss"] is not None
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu"} <= set(json.loads(lines[0]))
    assert "train loss" in capsys.readouterr().out
    assert (out / "model.pt").exists()
    measured = json.loads((out / "timeline_step2_measured.json").read_text())["traceEvents"]
    simulated = json.loads((out / "timeline_step2_simulated.json").read_text())["traceEvents"]
    names = lambda events: sorted(e["name"] for e in events if e["ph"] == "X")  # noqa: E731
    assert names(measured) == names(simulated) == sorted(f"0{k}{m}" for k in "FB" for m in range(4))


def test_train_launches_its_own_workers(tmp_path):
    """pp=2 x dp=2 through torch.distributed.run, as `pipekit train` does outside torchrun."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "pipekit.cli", "train", str(ROOT / "configs/toy.yaml"), "parallel.dp=2",
           "train.steps=4", "logging.log_every=2", "model.dim=16", "logging.progress=false", f"logging.out_dir={out}",
           "logging.trace_step=3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["summary"]
    assert (summary["pp"], summary["dp"], summary["steps"]) == (2, 2, 4)
    assert "pp=2 dp=2 tp=1" in proc.stdout
    measured = json.loads((out / "timeline_step3_measured.json").read_text())["traceEvents"]
    assert {e["tid"] for e in measured if e["ph"] == "X"} == {0, 1}  # both pipeline ranks, gathered


def test_version_and_show_print_what_a_user_needs(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out.startswith("pipekit ")
    config = str(ROOT / "configs/gpt2_tiny.yaml")
    assert main(["train", config, "train.precision=bf16", "optimizer.zero_stage=2", "--show"]) == 0
    shown = capsys.readouterr().out
    for line in ("precision: bf16", "zero_stage: 2", "device: auto", "loss_scale_window: 1000", "pp: 2"):
        assert line in shown, line
    assert load_config(config, ["train.precision=bf16"]).train.precision == "bf16"


def test_a_run_refuses_an_out_dir_holding_another_run(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    before = (tmp_path / "metrics.jsonl").read_bytes()
    config = str(ROOT / "configs/toy.yaml")
    assert main(["train", config, f"logging.out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "holds another run (metrics.jsonl)" in err and "logging.overwrite=true" in err
    assert (tmp_path / "metrics.jsonl").read_bytes() == before


def test_two_live_runs_cannot_share_an_out_dir(tmp_path, capsys):
    import fcntl

    with open(tmp_path / ".pipekit.lock", "a") as held:  # a live run holds the lock
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert main(["train", str(ROOT / "configs/toy.yaml"), f"logging.out_dir={tmp_path}", "--show"]) == 0
        capsys.readouterr()
        assert main(["train", str(ROOT / "configs/toy.yaml"), f"logging.out_dir={tmp_path}"]) == 2
        assert "another pipekit run is writing to logging.out_dir" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == [".pipekit.lock"]  # nothing else was written


def test_home_paths_expand_and_a_run_without_out_dir_says_so(tmp_path, capsys, monkeypatch):
    """`logging.out_dir=~/x` is the user's home, as in a shell (not a directory named `~`);
    a run with no out_dir says in one line that it keeps nothing."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(str(ROOT / "configs/toy.yaml"), ["logging.out_dir=~/runs/x", "checkpoint.dir=~/ck"])
    assert (cfg.logging.out_dir, cfg.checkpoint.dir) == (str(tmp_path / "runs/x"), str(tmp_path / "ck"))
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(ROOT / "configs/toy.yaml"), "parallel.pp=1", "train.steps=2", "logging.progress=false",
                 "logging.out_dir=null", "data.val_every=0"]) == 0
    assert "logging.out_dir is not set: no metrics.jsonl, checkpoints or model.pt will be written" in \
        capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_a_run_that_writes_nothing_leaves_no_out_dir(tmp_path, monkeypatch, capsys):
    """A run that fails before its first file (here: its worker returns 1 at once) removes the
    lock file and the directories it made for it, not one that holds anything else."""
    import pipekit.run.launch

    monkeypatch.setattr(pipekit.run.launch, "run_worker", lambda run: 1)
    toy = [str(ROOT / "configs/toy.yaml"), "parallel.pp=1", "logging.progress=false"]
    assert main(["train", *toy, f"logging.out_dir={tmp_path / 'new' / 'run'}"]) == 1
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    assert main(["train", *toy, f"logging.out_dir={tmp_path / 'kept'}", "logging.overwrite=true"]) == 1
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == [".pipekit.lock", "notes.txt"]


def test_a_worker_killed_without_a_word_is_named_with_its_signal(tmp_path, capsys):
    """A worker SIGKILLed (by hand, or the kernel's OOM killer) writes no error report: the
    launcher names the rank and the signal, and says how to continue."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    import pipekit.run.launch

    failures = {1: ProcessFailure(local_rank=1, pid=11, exitcode=-9, error_file=str(tmp_path / "none.json")),
                0: ProcessFailure(local_rank=0, pid=10, exitcode=3, error_file=str(tmp_path / "none.json"))}
    failures[1].timestamp += 1  # rank 0, which only lost its peer (PEER_STOPPED), was seen to fail first
    assert pipekit.run.launch.report_failures(ChildFailedError("pipekit.cli", failures), str(tmp_path)) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("pipekit train: worker rank 1 was killed by SIGKILL (sent from outside, or by the kernel's "
                   "out-of-memory killer) and left no error of its own; rank 0 stopped with it; continue from "
                   "the newest checkpoint with train.resume=auto (--max-restarts N restarts by itself)"), err


# ---- the device a launched run gets: said before its workers start ------------------------
GPT2_124M = str(ROOT / "configs/gpt2_124m.yaml")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT",
                 "PIPEKIT_ERROR_DIR")


@pytest.fixture
def gpus(monkeypatch):
    """How many GPUs this process sees (`pipekit.topology.count_visible_gpus`), outside torchrun;
    and the workers `pipekit train` would launch, recorded instead of started."""
    import pipekit.run.launch
    import pipekit.topology

    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    launched: list[tuple[int, list[str]]] = []
    monkeypatch.setattr(pipekit.run.launch, "launch", lambda nproc, argv, **kw: launched.append((nproc, argv)) or 0)

    def visible(n: int) -> list[tuple[int, list[str]]]:
        monkeypatch.setattr(pipekit.topology, "count_visible_gpus", lambda: n)
        return launched

    return visible


def test_a_gpu_config_without_a_gpu_says_once_before_launch_that_it_trains_on_the_cpu(gpus, tmp_path, capsys):
    """Issue 27: configs/gpt2_124m.yaml on a machine without a GPU launched 8 workers for 20,000
    steps without a word about the missing GPU."""
    launched = gpus(0)
    assert main(["train", GPT2_124M, f"logging.out_dir={tmp_path}"]) == 0
    out, err = capsys.readouterr()
    (nproc, argv), = launched
    assert nproc == 8 and argv[-1] == "train.device=cpu"
    assert err.splitlines() == ["pipekit: notice: train.device=auto: no GPU is visible (CUDA is not available), so "
                                "this run trains on the CPU with gloo: 8 workers for 20,000 steps; set "
                                "train.device=cpu to run on the CPU without this notice"], err


@pytest.mark.parametrize("visible, device", [(8, "cuda"), (0, "cpu")])
def test_no_device_notice_where_the_run_gets_what_it_asked_for(gpus, tmp_path, capsys, visible, device):
    """A GPU per worker under auto, or train.device=cpu asked for: nothing to say."""
    launched = gpus(visible)
    asked = "train.device=auto" if device == "cuda" else "train.device=cpu"
    assert main(["train", GPT2_124M, asked, f"logging.out_dir={tmp_path}"]) == 0
    (_, argv), = launched
    assert argv[-1] == f"train.device={device}"
    assert "notice" not in capsys.readouterr().err


def test_train_device_cuda_without_a_gpu_is_one_line_and_status_2(gpus, tmp_path, capsys):
    launched = gpus(0)
    assert main(["train", GPT2_124M, "train.device=cuda", f"logging.out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == ["pipekit train: train.device=cuda needs a GPU per local worker, but 0 GPUs visible "
                                "for 8 local workers; set train.device=cpu, or run on nodes with GPUs"], err
    assert launched == [] and list(tmp_path.iterdir()) == []
