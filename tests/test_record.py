"""One truth per run: each key acts where it is declared (a key given that does not act is refused;
a decay takes from Phase 1 only INHERITED), the record (run.json, detour.py) reruns bitwise, a run
knows its data, an export is whole or absent, and a checkpoint is data, never code. A test per kind."""
import ast
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import detour
from conftest import ROOT, TINY_DECAY, TINY_INIT, TINY_RUN
from data import prepare

TIMING = ("tok_per_s", "mfu")


def records(out):
    with open(os.path.join(out, "log.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in f if line.strip()]


def error_of(argv):
    with pytest.raises(SystemExit) as e:
        detour.main(argv)
    line = str(e.value.code)
    assert line.startswith("error: ") and "\n" not in line and "; " in line, line
    return line


@pytest.fixture(scope="module")
def phase1(tmp_path_factory):
    """Prepared data (with its tokenizer) and a finished tiny CLM run on it."""
    root = tmp_path_factory.mktemp("record")
    data = str(root / "data")
    prepare.main(["--register", "bio", "--n_docs", "300", "--vocab_size", "512", "--val_fraction", "0.05", "--out_dir", data])
    out = str(root / "clm")
    detour.main(["--data_dir", data, "--phase", "clm", "--max_tokens", "4096", "--out_dir", out, *TINY_RUN])
    return dict(root=root, data=data, out=out)


# ---- 1. each key acts where it is declared ----

@pytest.mark.parametrize("kind,argv,match", [
    ("Phase 1's key on a decay", ["--phase", "decay", "--init_from", "{out}", "--max_tokens", "9999"],
     "--max_tokens does not act in this run (it acts in --phase clm | mlm)"),
    ("the decay's key on Phase 1", ["--phase", "clm", "--init_from", "scratch", "--decay_ratio", "0.2"],
     "--decay_ratio does not act in this run (it acts in --phase decay)"),
    ("MLM's key on CLM", ["--phase", "clm", "--init_from", "scratch", "--mlm_rate", "0.4"], "--mlm_rate does not act in this run"),
    ("a shape with a checkpoint", ["--phase", "clm", "--init_from", "{out}", "--preset", "small"],
     "--preset does not act in this run (it acts with --init_from scratch"),
    ("a key another key overrides", ["--phase", "decay", "--init_from", "{out}", "--decay_tokens", "1024",
                                     "--decay_ratio", "0.2"], "--decay_ratio does not act in this run"),
    ("a key of a start on a resume", ["--init_from", "resume", "--out_dir", "{out}", "--overwrite", "true"],
     "--overwrite does not act in this run (it acts when a run starts"),
    ("a tracker's key without the tracker", ["--phase", "clm", "--init_from", "scratch", "--wandb_project", "p"],
     "--wandb_project does not act in this run (it acts with --wandb_log true)"),
])
def test_a_given_key_that_does_not_act_is_refused(phase1, kind, argv, match):
    argv = [a.format(**phase1) for a in argv]
    out = str(phase1["root"] / "refused")
    line = error_of(["--data_dir", phase1["data"], "--out_dir", out, *argv])
    assert match in line, (kind, line)
    assert not os.path.exists(out)  # nothing written


def edited_copy(tmp_path, **constants):
    """detour.py copied with constants of section 1 edited, as a student makes an ablation."""
    source = open(os.path.join(ROOT, "detour.py")).read()
    for key, value in constants.items():
        source, n = re.subn(rf"^{key} = .*$", f"{key} = {value!r}", source, count=1, flags=re.M)
        assert n == 1, key
    path = tmp_path / "detour.py"
    path.write_text(source)
    return str(path)


def run_file(path, argv):
    r = subprocess.run([sys.executable, path, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_an_edited_decay_constant_acts_and_the_record_says_so(phase1, tmp_path):
    """A student edits the decay's constants after Phase 1 ran: the decay runs them, its checkpoint and its
    run.json record them, and its saved detour.py is the edited file."""
    path = edited_copy(tmp_path, decay_mlm_rate=0.2, decay_ratio=0.5)
    out = str(tmp_path / "decay")
    run_file(path, ["--phase", "decay", "--init_from", phase1["out"], "--out_dir", out, *TINY_DECAY])
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    assert ckpt["config"]["decay_mlm_rate"] == 0.2 and ckpt["config"]["decay_ratio"] == 0.5
    assert ckpt["step"] == 4  # 0.5 x Phase 1's 8 steps (the unedited 0.1 would be 1)
    saved = json.load(open(os.path.join(out, "run.json")))
    assert saved["decay_mlm_rate"] == 0.2 and saved["decay_ratio"] == 0.5
    assert open(os.path.join(out, "detour.py")).read() == open(path).read()


def test_a_key_outside_inherited_is_the_running_files(phase1, tmp_path):
    """Phase 1 ran with keys of its own (frozen layers, its evaluation): the decay runs this file's values for
    every key not in INHERITED, as it would for a constant a student adds; INHERITED comes from Phase 1."""
    p1 = str(tmp_path / "p1")
    detour.main(["--data_dir", phase1["data"], "--phase", "clm", "--max_tokens", "4096", "--out_dir", p1,
                 *TINY_RUN, "--freeze_layers", "0"])
    out = str(tmp_path / "decay")
    model = detour.main(["--phase", "decay", "--init_from", p1, "--out_dir", out, "--progress", "false",
                         "--decay_tokens", "1024", "--eval_tokens", "1024"])
    saved = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["config"]
    assert saved["freeze_layers"] == detour.DEFAULTS["freeze_layers"]
    assert saved["log_interval"] == detour.DEFAULTS["log_interval"] != 1  # Phase 1 ran with 1
    assert all(p.requires_grad for p in model.parameters())  # nothing frozen: the file's freeze_layers
    phase1_saved = torch.load(os.path.join(p1, "ckpt.pt"), weights_only=True)["config"]
    assert {k: saved[k] for k in detour.INHERITED} == {k: phase1_saved[k] for k in detour.INHERITED}


def test_an_inherited_value_that_differs_from_the_file_is_said(phase1, tmp_path, capsys):
    out = str(tmp_path / "decay")
    detour.main(["--phase", "decay", "--init_from", phase1["out"], "--out_dir", out, "--progress", "false",
                 "--decay_tokens", "1024", "--eval_tokens", "1024", "--grad_clip", "0.5"])
    text = capsys.readouterr().out
    assert f"learning_rate 0.003 (this file: {detour.DEFAULTS['learning_rate']!r})" in text  # Phase 1's runs
    assert "the command line's values run, not" in text and "grad_clip 0.5" in text
    saved = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["config"]
    assert saved["learning_rate"] == 0.003 and saved["grad_clip"] == 0.5


# ---- 2. the record is the truth ----

@pytest.mark.parametrize("which", ["clm", "decay"])
def test_the_saved_copy_and_run_json_rerun_bitwise(phase1, tmp_path, which):
    """`python out/x/detour.py out/x/run.json --out_dir other` is the same run: log.jsonl equal but for its
    wall-clock fields."""
    first = phase1["out"]
    if which == "decay":
        first = str(tmp_path / "decay")
        detour.main(["--phase", "decay", "--init_from", phase1["out"], "--out_dir", first, *TINY_DECAY,
                     "--decay_tokens", "1024"])
    again = str(tmp_path / "again")
    run_file(os.path.join(first, "detour.py"), [os.path.join(first, "run.json"), "--out_dir", again])
    assert records(again) == records(first)
    assert (torch.load(os.path.join(again, "ckpt.pt"), weights_only=True)["model"].keys()
            == torch.load(os.path.join(first, "ckpt.pt"), weights_only=True)["model"].keys())
    assert open(os.path.join(again, "hf", "model.safetensors"), "rb").read() == \
        open(os.path.join(first, "hf", "model.safetensors"), "rb").read()


def test_the_phase_table_holds_what_acts():
    """A phase's batch and schedule are functions of its row (no string matched elsewhere), and a phase's
    name appears in the code only in PHASES: a new row is a new phase."""
    for row in detour.PHASES.values():
        assert callable(row.batch) and callable(row.schedule)
        assert row.rate is None or row.rate in detour.DEFAULTS
        assert all(key in detour.DEFAULTS for key in row.reads)
    code = open(os.path.join(ROOT, "detour.py")).read().split("\nPHASES = {")[1].split("\n}\n", 1)[1]
    for name in detour.PHASES:
        quoted = re.findall(rf"[\"']{name}[\"']", code)
        assert quoted == [] or name == detour.DEFAULTS["phase"], (name, quoted)


def test_a_new_phase_row_runs_its_own_functions(tiny_data, tmp_path, monkeypatch):
    """An ablation that is a table row: a Phase-1 variant with its own schedule (linear decay from the
    start), declared in PHASES only, runs that schedule."""
    def linear(cfg, tokens, total, step_tokens):
        return cfg.learning_rate * (1 - tokens / total)

    row = detour.replace(detour.PHASES["clm"], schedule=linear)
    monkeypatch.setitem(detour.PHASES, "clm-linear", row)
    monkeypatch.setitem(detour.RULES, "phase", detour.one_of(*detour.PHASES))  # as the file's RULES would
    out = str(tmp_path / "o")
    detour.main(["--data_dir", tiny_data, "--phase", "clm-linear", "--max_tokens", "2048", "--out_dir", out,
                 *TINY_RUN])
    lrs = [r["lr"] for r in records(out) if "loss" in r]
    assert lrs == [pytest.approx(3e-3 * (1 - i / 4)) for i in range(4)]


# ---- 5. a run knows its data ----

def other_data(phase1, name, edit):
    """A copy of the prepared data with one file edited."""
    path = str(phase1["root"] / name)
    if not os.path.exists(path):
        shutil.copytree(phase1["data"], path)
        edit(path)
    return path


def reprepared(path):
    """The data prepared again with another tokenizer (the same text, other ids)."""
    meta = json.load(open(os.path.join(path, "meta.json")))
    meta["source"] = "re-prepared"
    json.dump(meta, open(os.path.join(path, "meta.json"), "w"))


@pytest.mark.parametrize("how", [["--init_from", "resume", "--out_dir", "{out}"],
                                 ["--phase", "decay", "--init_from", "{out}", "--out_dir", "{root}/d"]])
def test_a_run_on_data_of_another_identity_is_refused_unless_meant(phase1, how, capsys):
    data = other_data(phase1, "other", reprepared)
    argv = [a.format(**phase1) for a in how] + ["--data_dir", data, "--progress", "false", "--eval_tokens", "1024"]
    if "decay" in how:
        argv += ["--decay_tokens", "1024"]
    line = error_of(argv)
    assert f"{data} is not the data" in line and phase1["data"] in line and "meta.json" in line
    assert "--new_data true" in line
    if "decay" in how:
        detour.main(argv + ["--new_data", "true"])
        assert "--new_data: running on" in capsys.readouterr().out


@pytest.mark.parametrize("name,edit,match", [
    ("swapped", lambda m: {**m, "cls_token_id": m["sep_token_id"], "sep_token_id": m["cls_token_id"]},
     "tokenizer.json has [CLS] at id"),
    ("bigger", lambda m: {**m, "vocab_size": m["vocab_size"] + 1}, "tokenizer.json has 512 tokens but"),
    ("dtype", lambda m: {**m, "dtype": "uint32"}, "train.bin does not hold"),
    ("typed", lambda m: {**m, "vocab_size": "512"}, "has vocab_size '512', not a positive integer"),
    ("ids", lambda m: {**m, "mask_token_id": 9999}, "has mask_token_id 9999, not an id below vocab_size"),
])
def test_meta_that_disagrees_with_its_files_is_one_line(phase1, tmp_path, name, edit, match):
    def write(path):
        p = os.path.join(path, "meta.json")
        json.dump(edit(json.load(open(p))), open(p, "w"))

    data = other_data(phase1, "meta_" + name, write)
    line = error_of(["--data_dir", data, "--out_dir", str(tmp_path / "o"), "--max_tokens", "2048", *TINY_RUN])
    assert match in line and "data/prepare.py" in line, line


def test_an_out_of_vocabulary_id_in_val_is_refused_at_start(phase1, tmp_path):
    def poison(path):
        meta = json.load(open(os.path.join(path, "meta.json")))
        val = detour.np.fromfile(os.path.join(path, "val.bin"), dtype=meta["dtype"])
        val[len(val) // 2] = meta["vocab_size"] + 7
        val.tofile(os.path.join(path, "val.bin"))

    data = other_data(phase1, "val_oov", poison)
    out = str(tmp_path / "o")
    line = error_of(["--data_dir", data, "--out_dir", out, "--max_tokens", "2048", *TINY_RUN])
    assert "val.bin" in line and "519" in line, line
    assert not os.path.exists(os.path.join(out, "ckpt.pt"))  # refused before any step


# ---- 6. an export is whole or absent, and always recoverable ----

def finished_run(phase1, tmp_path):
    out = str(tmp_path / "run")
    shutil.copytree(phase1["out"], out)
    return out


@pytest.mark.parametrize("rerun", [["--autoresume", "true", "--phase", "clm"], ["--init_from", "resume"]])
def test_an_export_cut_by_a_kill_is_written_again(phase1, tmp_path, monkeypatch, rerun):
    out = finished_run(phase1, tmp_path)
    whole = {f: open(os.path.join(out, "hf", f), "rb").read() for f in os.listdir(os.path.join(out, "hf"))}
    monkeypatch.setattr(detour, "replace_directory", lambda new, path: os.kill(os.getpid(), 9) and None)
    monkeypatch.setattr(os, "kill", lambda pid, sig: (_ for _ in ()).throw(KeyboardInterrupt()))
    model = detour.ModernBERT(detour.Config(**torch.load(os.path.join(out, "ckpt.pt"),
                                                         weights_only=True)["model_args"]))
    with pytest.raises(KeyboardInterrupt):  # a kill before the export is put in place: the earlier one stays
        detour.save_hf(model, os.path.join(out, "hf"))
    assert {f: open(os.path.join(out, "hf", f), "rb").read() for f in whole} == whole
    assert os.path.exists(os.path.join(out, ".hf.partial"))
    monkeypatch.undo()
    shutil.rmtree(os.path.join(out, "hf"))  # a kill between its two renames: no export there
    args = ["--init_from", "resume", "--out_dir", out, "--progress", "false"]
    if "--autoresume" in rerun:
        args = [*rerun, "--out_dir", out, "--data_dir", phase1["data"], "--max_tokens", "4096", *TINY_RUN]
    detour.main(args)
    assert {f: open(os.path.join(out, "hf", f), "rb").read() for f in whole} == whole
    assert not os.path.exists(os.path.join(out, ".hf.partial"))
    if "--autoresume" in rerun:
        assert detour.main(args) is None  # now finished and whole: nothing to do


def test_a_fresh_run_over_an_old_one_removes_the_old_runs_files(phase1, tmp_path, monkeypatch):
    """--overwrite true over a finished run, stopped at its first step: the old export is gone, not read as the
    new run's."""
    out = finished_run(phase1, tmp_path)
    monkeypatch.setattr(detour.StopRequest, "requested", lambda self: True)
    detour.main(["--data_dir", phase1["data"], "--phase", "mlm", "--max_tokens", "4096", "--out_dir", out,
                 "--overwrite", "true", *TINY_RUN])
    assert not os.path.exists(os.path.join(out, "hf"))
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["phase"] == "mlm"
    with pytest.raises(SystemExit, match="has ckpt.pt but no hf/ export"):
        detour.load_encoder(out)


def test_a_signal_during_the_final_export_does_not_say_stopped(phase1, tmp_path, monkeypatch, capsys):
    save = detour.save_hf

    def interrupted(model, directory, tokenizer_path=None):
        if os.path.basename(directory) == "hf":  # the final export, not init/ at the start
            os.kill(os.getpid(), 2)  # SIGINT, as Ctrl-C after the last step
        save(model, directory, tokenizer_path)

    monkeypatch.setattr(detour, "save_hf", interrupted)
    out = str(tmp_path / "o")
    detour.main(["--data_dir", phase1["data"], "--phase", "clm", "--max_tokens", "2048", "--out_dir", out,
                 *TINY_RUN])
    text = capsys.readouterr().out
    assert "stopped" not in text and "detour: done" in text
    assert detour.export_whole(os.path.join(out, "hf"), "tokenizer.json")


# ---- 7. one line for what detour did not write, or what does not agree with itself ----

def hf_copy(phase1, tmp_path, edit):
    path = tmp_path / "hf"
    shutil.copytree(os.path.join(phase1["out"], "hf"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(edit(config)))
    return str(path)


@pytest.mark.parametrize("edit", [
    lambda c: {**c, "hidden_size": 32},  # the weights' sizes
    lambda c: {**c, "num_attention_heads": 3},  # the config with itself: 64 is not a multiple of 3
    lambda c: {**c, "layer_types": ["full_attention"]},  # one layer type for three layers
    lambda c: {**c, "num_hidden_layers": 2},  # the weights' layers
    lambda c: {**c, "vocab_size": "many"},
])
def test_an_hf_config_that_disagrees_is_one_line(phase1, tmp_path, edit):
    src = hf_copy(phase1, tmp_path, edit)
    line = error_of(["--data_dir", phase1["data"], "--init_from", src, "--out_dir", str(tmp_path / "o"),
                     "--max_tokens", "2048", *TINY_INIT])
    assert "config.json" in line and "re-export or re-download it" in line, line


class Payload:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@pytest.mark.parametrize("kind", ["nanogpt", "state_dict", "payload", "garbage"])
def test_a_checkpoint_detour_did_not_write_is_one_line_and_never_runs(phase1, tmp_path, kind):
    out = tmp_path / "foreign"
    out.mkdir()
    state = torch.load(os.path.join(phase1["out"], "ckpt.pt"), weights_only=True)["model"]
    ran = tmp_path / "payload-ran"
    objects = {"nanogpt": {"model": state, "optimizer": {}, "model_args": {"n_layer": 3}, "iter_num": 5,
                           "best_val_loss": 1.0, "config": {}},
               "state_dict": state, "payload": {"model": state, "x": Payload(ran)}}
    if kind == "garbage":
        (out / "ckpt.pt").write_bytes(b"not a checkpoint")
    else:
        torch.save(objects[kind], out / "ckpt.pt")
    for argv in (["--init_from", "resume", "--out_dir", str(out)],
                 ["--phase", "decay", "--init_from", str(out), "--out_dir", str(tmp_path / "d")]):
        line = error_of([*argv, "--data_dir", phase1["data"]])
        assert "ckpt.pt" in line, line
    assert not ran.exists()  # the pickle's payload did not run


def unsafe_loads(path):
    """The torch.load calls of a Python file without weights_only=True, as path:line."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    return [f"{path}:{node.lineno}" for node in ast.walk(tree)
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load"
            and not any(k.arg == "weights_only" and ast.unparse(k.value) == "True" for k in node.keywords)]


def test_every_checkpoint_load_in_the_project_is_the_safe_loader():
    """Every torch.load in the project's scripts and tests is torch's safe loader (weights_only=True)."""
    paths = [os.path.relpath(os.path.join(d, f), ROOT) for d, _, files in os.walk(ROOT) for f in files
             if f.endswith(".py") and os.path.relpath(d, ROOT).split(os.sep)[0] not in (".git", "out")]
    assert len(paths) > 20 and "detour.py" in paths
    assert [hit for path in paths for hit in unsafe_loads(path)] == []


@pytest.mark.parametrize("key,value,ok", [("seed", 2**32 - 1, True), ("seed", 2**32, False),
                                          ("data_seed", -1, False), ("data_seed", 2**32, False)])
def test_seeds_are_bounded_to_what_the_generators_take(tiny_data, tmp_path, key, value, ok):
    argv = ["--data_dir", tiny_data, "--out_dir", str(tmp_path / "o"), "--max_tokens", "1024", *TINY_RUN,
            f"--{key}", str(value)]
    if ok:
        detour.main(argv)
    else:
        assert f"--{key} {value} must be in [0, 2^32)" in error_of(argv)


@pytest.mark.parametrize("text", ["inf", "1e999", "nan", "-inf"])
def test_a_float_that_is_not_finite_is_refused_at_start(tiny_data, tmp_path, text):
    out = str(tmp_path / "o")
    line = error_of(["--data_dir", tiny_data, "--out_dir", out, *TINY_RUN, "--learning_rate", text])
    assert f"--learning_rate expects a finite number, got '{text}'" in line
    assert not os.path.exists(out)


def test_a_resumed_key_this_file_lacks_is_said(phase1, tmp_path, capsys):
    """A constant removed or renamed since the run started cannot act: a line says so, not a silent drop."""
    out = finished_run(phase1, tmp_path)
    path = os.path.join(out, "ckpt.pt")
    ckpt = torch.load(path, weights_only=True)
    ckpt["config"]["old_knob"] = 3
    torch.save(ckpt, path)
    detour.main(["--init_from", "resume", "--out_dir", out, "--progress", "false"])
    assert f"{out}'s configuration has old_knob, which this file does not" in capsys.readouterr().out


# ---- 8. continued pretraining is the default: θ0 scored before, nothing started from nothing ----

def test_a_run_from_trained_weights_scores_them_first_as_every_decay_is_scored(phase1, tmp_path, capsys):
    """A Phase-1 run from an encoder (θ0's HF export here: phase1's) records it at step 0 on this data by the
    decay's objective, beside the unigram, before training it; the figures are the decay's own evaluation of the
    same weights (same windows, same masks). A run from scratch and a resume score nothing at step 0."""
    theta0 = os.path.join(phase1["out"], "hf")
    out = str(tmp_path / "clm")
    detour.main(["--data_dir", phase1["data"], "--phase", "clm", "--init_from", theta0, "--max_tokens", "2048",
                 "--out_dir", out, *TINY_INIT])
    start = records(out)[0]
    assert set(start) == {"step", "tokens", "start_val_loss", "start_val_acc", "start_val_unigram"}
    assert start["step"] == 0 and records(out)[1]["step"] > 0
    printed = capsys.readouterr().out
    assert (f"step 0: {theta0} on this data, before clm: val decay loss {start['start_val_loss']:.4f} (unigram "
            f"{start['start_val_unigram']:.4f})") in printed
    # the same weights as a decay of phase1's run evaluates them before its first step
    cfg, ckpt = detour.resolve(["--data_dir", phase1["data"], "--phase", "decay", "--init_from", phase1["out"],
                                "--out_dir", str(tmp_path / "decay"), "--decay_tokens", "512", *TINY_DECAY])
    run = detour.setup(cfg, ckpt)
    ev = detour.evaluate(run.raw_model, cfg, run)
    assert round(ev["loss"], 5) == start["start_val_loss"] and round(ev["unigram"], 5) == start["start_val_unigram"]
    assert not any("start_val_loss" in r for r in records(phase1["out"]))  # phase1 ran from scratch
    stopped = str(tmp_path / "stopped")
    detour.main(["--data_dir", phase1["data"], "--phase", "clm", "--init_from", theta0, "--max_tokens", "4096",
                 "--out_dir", stopped, *TINY_INIT, "--ckpt_interval", "2"])
    ckpt = torch.load(os.path.join(stopped, "ckpt.pt"), weights_only=True)
    ckpt["step"] = 2  # as if stopped at step 2: the resume starts there, and θ0 is not scored again
    torch.save(ckpt, os.path.join(stopped, "ckpt.pt"))
    capsys.readouterr()
    detour.main(["--init_from", "resume", "--out_dir", stopped, "--progress", "false"])
    assert "step 0:" not in capsys.readouterr().out


def test_nothing_to_start_from_names_what_builds_it(phase1, tmp_path):
    """The default --init_from is θ0's export, which runs/theta0.sh builds: where it is missing, one line says so
    (not a missing config.json); a decay names its Phase-1 run, never the default."""
    out = str(tmp_path / "o")
    line = error_of(["--data_dir", phase1["data"], "--init_from", str(tmp_path / "theta0" / "hf"), "--out_dir", out,
                     *TINY_INIT])
    assert f"--init_from {tmp_path}/theta0/hf: no model there" in line and "bash runs/theta0.sh" in line
    assert "--init_from scratch" in line
    line = error_of(["--data_dir", phase1["data"], "--phase", "decay", "--out_dir", out, *TINY_DECAY])
    assert "--phase decay starts from a Phase-1 checkpoint (clm or mlm); pass --init_from out/clm" in line
    assert not os.path.exists(out)
