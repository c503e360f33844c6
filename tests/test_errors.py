"""Every bad input is one line, `error: <what> ...; <how to fix it>`, exit status 1, no traceback,
and what exists stays as it was: a prepared dataset and a checkpoint are byte-identical after a
failed run that would have overwritten them (every row points its outputs at them). One row per
case; most run main(argv) in process, the rows marked `cli` run the real command line. Also --help."""
import hashlib
import os
import shutil
import subprocess
import sys

import pytest
import torch

import detour
import finetune as ft
from data import prepare
from studies import analysis
from conftest import ROOT

TINY = ["--init_from", "scratch", "--preset", "tiny", "--seq_len", "64", "--batch_size", "4", "--global_batch_size", "8", "--progress", "false",
        "--eval_interval", "4", "--eval_tokens", "512", "--warmup_tokens", "512", "--max_tokens", "2048"]
PROGRAMS = {"detour": (detour.main, "detour.py"), "prepare": (prepare.main, "data/prepare.py"),
            "finetune": (ft.main, "finetune.py"), "analysis": (analysis.main, "studies/analysis.py")}
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A dataset prepared by data/prepare.py, a tiny clm run on it, and broken copies of its files."""
    root = str(tmp_path_factory.mktemp("bad"))
    data, out = os.path.join(root, "data"), os.path.join(root, "clm")
    prepare.main(["--register", "bio", "--n_docs", "300", "--vocab_size", "512", "--val_fraction", "0.05", "--out_dir", data])
    detour.main(["--data_dir", data, "--out_dir", out, *TINY])

    def copy(name, broken):  # the dataset with one file replaced by `broken` bytes
        os.makedirs(os.path.join(root, name))
        for f in os.listdir(data):
            body = broken[1] if f == broken[0] else open(os.path.join(data, f), "rb").read()
            open(os.path.join(root, name, f), "wb").write(body)

    copy("garbage_meta", ("meta.json", b"{\"vocab_size\": 512,"))
    copy("meta_no_keys", ("meta.json", b"{\"vocab_size\": 512}"))
    copy("odd_bin", ("train.bin", open(os.path.join(data, "train.bin"), "rb").read()[:-1]))
    copy("bad_tokenizer", ("tokenizer.json", b"{\"version\": \"1.0\"}"))
    open(os.path.join(root, "latin1.txt"), "wb").write("caf\xe9 au lait\nun autre document\n".encode("latin-1"))
    open(os.path.join(root, "ok.txt"), "w").write("one document\nanother document\n")
    open(os.path.join(root, "tokenizer.json"), "w").write("{not json")
    os.makedirs(os.path.join(root, "bad_tok_ckpt"))
    for f in os.listdir(os.path.join(out, "hf")):
        body = b"{}" if f == "tokenizer.json" else open(os.path.join(out, "hf", f), "rb").read()
        open(os.path.join(root, "bad_tok_ckpt", f), "wb").write(body)
    os.makedirs(os.path.join(root, "task"))
    for split in ("train", "dev", "test"):
        open(os.path.join(root, "task", split + ".jsonl"), "wb").write(b'{"text": "caf\xe9", "label": "a"}\n')
    os.makedirs(os.path.join(root, "good_task"))
    for split in ("train", "dev", "test"):
        rows = "".join(f'{{"text": "document {i}", "label": "{"ab"[i % 2]}"}}\n' for i in range(8))
        open(os.path.join(root, "good_task", split + ".jsonl"), "w").write(rows)
    shutil.copytree(os.path.join(out, "hf"), os.path.join(root, "clm_copy"))  # a second checkpoint
    for name, split_text in (("nan_task", "sentence\tscore\nsome text\t0.5\nmore text\tnan\n"),  # a NaN label
                             ("bilou_task", "aspirin\tU-DRUG\nhelps\tO\n")):  # a tag of no scheme read
        os.makedirs(os.path.join(root, name))
        for split in ("train", "dev", "test"):
            open(os.path.join(root, name, split + ".tsv"), "w").write(split_text)
    os.makedirs(os.path.join(root, "iob1_task"))  # an I- that continues nothing: strict scoring would drop it
    for split in ("train", "dev", "test"):
        open(os.path.join(root, "iob1_task", split + ".tsv"), "w").write("aspirin\tB-DRUG\n\nhelps\tI-DRUG\n")
    return dict(root=root, data=data, out=out)


def snapshot(*dirs):
    return {os.path.join(d, f): hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
            for top in dirs for d, _, files in os.walk(top) for f in files}


# (program, arguments (after those pointing the outputs at the existing dataset / checkpoint), what the
# one line must contain, "cli" to run the real command line)
ROWS = [
    ("detour", "--seq_len 0", "--seq_len 0 must be > 0", ""),
    ("detour", "--batch_size -1", "--batch_size -1 must be > 0", ""),
    ("detour", "--global_batch_size 10", "global_batch_size 10 is not a multiple of batch_size x ranks = 4", ""),
    ("detour", "--max_tokens 0", "--max_tokens 0 must be > 0", ""),
    ("detour", "--learning_rate 0", "--learning_rate 0.0 must be > 0", ""),
    ("detour", "--phase mlm --mlm_rate 1.5", "--mlm_rate 1.5 must be in (0, 1)", ""),
    ("detour", "--phase decay --init_from {out} --decay_mlm_rate 0", "--decay_mlm_rate 0.0 must be in (0, 1)", ""),
    ("detour", "--phase decay --init_from {out} --decay_ratio 0", "--decay_ratio 0.0 must be in (0, 1]", ""),
    ("detour", "--warmup_tokens -1", "--warmup_tokens -1 must be >= 0", ""),
    ("detour", "--min_lr_ratio 2", "--min_lr_ratio 2.0 must be in [0, 1]", ""),
    ("detour", "--beta1 1", "--beta1 1.0 must be in [0, 1)", ""),
    ("detour", "--eps 0", "--eps 0.0 must be > 0", ""),
    ("detour", "--weight_decay -1e-5", "--weight_decay -1e-05 must be >= 0", ""),
    ("detour", "--dtype fp16", "--dtype 'fp16' must be one of auto | float32 | bfloat16", "cli"),
    ("detour", "--attn_backend xformers", "--attn_backend 'xformers' must be one of auto | sdpa | varlen", ""),
    pytest.param("detour", "--device cuda", "--device 'cuda' must be auto | cpu | cuda | cuda:N", "cli", marks=NO_GPU),
    ("detour", f"--device cuda:{torch.cuda.device_count()}", "a device this machine has", ""),
    ("detour", "--device tpu", "--device 'tpu' must be auto | cpu | cuda | cuda:N", ""),
    ("detour", "--eval_interval 0", "--eval_interval 0 must be > 0", ""),
    ("detour", "--ckpt_interval -5", "--ckpt_interval -5 must be > 0", ""),
    ("detour", "--phase sft", "--phase 'sft' must be one of clm | mlm | decay", ""),
    ("detour", "--preset huge", "--preset 'huge' must be one of tiny | small | medium | base | large", ""),
    ("detour", "--init_from=", "--init_from '' must be not empty", ""),
    ("detour", "--seq_len long", "--seq_len expects an integer, got 'long'; e.g. --seq_len 64", ""),
    ("detour", "--data_dir {root}/garbage_meta", "garbage_meta/meta.json is not valid JSON", "cli"),
    ("detour", "--data_dir {root}/meta_no_keys", "meta_no_keys/meta.json lacks pad_token_id, cls_token_id", ""),
    ("detour", "--data_dir {root}/odd_bin", "odd_bin/train.bin does not hold", ""),
    ("detour", "--data_dir {root}/bad_tokenizer", "bad_tokenizer/tokenizer.json is not a tokenizer.json", ""),
    ("detour", "--data_dir {root}/ok.txt", "ok.txt' must be not empty, a directory, not a file", "cli"),
    ("detour", "--out_dir {root}/ok.txt", "ok.txt' must be a directory, not a file", ""),
    ("detour", "--init_from {root}/ok.txt", "ok.txt' must be not empty, a directory, not a file", ""),
    ("detour", "--out_dir {root}/ok.txt/sub", "cannot create the directory ", "cli"),
    ("decay", "--phase decay --init_from {out} --decay_tokens 100", "--decay_tokens 100 is less than one optimizer", ""),
    ("prepare", "--input {root}/latin1.txt", "latin1.txt is not UTF-8 text", "cli"),
    ("prepare", "--register bio --n_docs 50 --tokenizer {root}/tokenizer.json", "tokenizer.json is not a tokenizer.json the", ""),
    ("prepare", "--vocab_size 0", "--vocab_size 0 must be >= 261", ""),
    ("prepare", "--val_fraction 1", "--val_fraction 1.0 must be in (0, 1)", ""),
    ("prepare", "--n_docs 1", "--n_docs 1 must be >= 2", ""),
    ("prepare", "--input {root}/ok.txt --group_tokens 0", "--group_tokens 0 must be > 0", ""),
    ("prepare", "--vocab_size many", "argument --vocab_size: invalid int value: 'many'", "cli"),
    ("prepare", "--n_docs 50 --out_dir {root}/ok.txt", "ok.txt is a file; give a directory", "cli"),
    ("prepare", "--n_docs 50 --out_dir {root}/ok.txt/data", "ok.txt/data is under ", "cli"),
    ("prepare", "--n_docs 50 --out_dir {root}/ok.txt/a/b", "ok.txt, which is a file; give a directory path", ""),
    ("prepare", "--input {root}/missing.txt", "missing.txt; check the --input path", "cli"),
    ("prepare", "--register bio --n_docs 50 --tokenizer {root}/task", "task is a directory; give the tokenizer.json file in it", ""),
    # an option given that does not act in this run (prepare.ACTS), and an input read twice or its own output
    ("prepare", "--input {root}/ok.txt --n_docs 50", "--n_docs does not act with --input", "cli"),
    ("prepare", "--n_docs 50 --group_tokens 9", "--group_tokens does not act with the generated corpus", ""),
    ("prepare", "--register bio --n_docs 50 --tokenizer {data}/tokenizer.json --vocab_size 300", "--vocab_size does not act with", ""),
    ("prepare", "--input {root}/ok.txt {data}/../ok.txt", "/ok.txt twice (", ""),
    ("prepare", "--input {data}/val.txt", "/data/val.txt is a file this run writes", ""),
    ("prepare", "--n_docs 50 --tokenizer {data}/tokenizer.json", "--tokenizer does not act with --register pair (the pair's "
     "tokenizer is trained on its general corpus); drop --tokenizer, or give --register bio or general", ""),
    ("finetune", "--seeds 0", "--seeds 0 must be > 0", "cli"),
    ("finetune", "--epochs 0", "--epochs 0 must be > 0", ""),
    ("finetune", "--ner_epochs -1", "--ner_epochs -1 must be > 0", ""),
    ("finetune", "--batch_size 0", "--batch_size 0 must be > 0", ""),
    ("finetune", "--learning_rate 0", "--learning_rate 0.0 must be > 0", ""),
    ("finetune", "--warmup_ratio 1", "--warmup_ratio 1.0 must be in [0, 1)", ""),
    ("finetune", "--max_len 2", "--max_len 2 must be >= 3", ""),
    ("finetune", "--pooling max", "--pooling 'max' must be one of cls | mean", ""),
    ("finetune", "--pos_weight -1", "--pos_weight '-1' must be none | auto | a finite number > 0", ""),
    ("finetune", "--pos_weight .", "--pos_weight '.' must be none | auto | a finite number > 0", ""),
    ("finetune", "--pos_weight 1e999", "--pos_weight '1e999' must be none | auto | a finite number > 0", ""),
    ("finetune", "--learning_rate 1e999", "--learning_rate expects a finite number, got '1e999'", ""),
    ("finetune", "--weight_decay inf", "--weight_decay expects a finite number, got 'inf'", ""),
    ("detour", "--learning_rate 1e999", "--learning_rate expects a finite number, got '1e999'", ""),
    ("analysis", "--analysis pca", "--analysis 'pca' must be one of cka | drift | transplant", ""),
    ("analysis", "--seeds 0", "--seeds 0 must be > 0; see python studies/analysis.py --help", "cli"),
    ("finetune", "--analysis cka", "unknown option --analysis", ""),
    ("finetune", "--dtype fp16", "--dtype 'fp16' must be one of auto | float32 | bfloat16", ""),
    ("finetune", "--device tpu", "--device 'tpu' must be auto | cpu | cuda | cuda:N", ""),
    ("finetune", "--ckpts=", "--ckpts '' must be not empty", ""),
    ("analysis", "--analysis cka --ckpts {root}/bad_tok_ckpt,{out} --pretrain_dir {data}", "bad_tok_ckpt/tokenizer.json "
     "is not a", ""),
    ("finetune", "--tasks t=cls:{root}/task --ckpts {out} --seeds 1", "task/train.jsonl is not UTF-8 text", ""),
    ("finetune", "--shard 2/2", "--shard '2/2' must be i/n with 0 <= i < n", "cli"),
    ("finetune", "--shard 1", "--shard '1' must be i/n with 0 <= i < n", ""),
    ("finetune", "--out_dir {root}/ok.txt", "ok.txt' must be a directory, not a file", "cli"),
    ("finetune", "--tasks_dir {root}/ok.txt", "ok.txt' must be a directory, not a file; see", ""),
    ("finetune", "--tasks t=cls:{root}/ok.txt --seeds 1", "ok.txt is a file; give the directory that holds the split files", ""),
    ("analysis", "--analysis cka --ckpts {out},{out} --texts {root}", " is not a file; pass --texts (a file", ""),
    # a path written under a regular file: one line naming it, not os.makedirs' traceback
    ("finetune", "--tasks t=cls:{root}/good_task --seeds 1 --epochs 1 --out_dir {root}/ok.txt/ft",
     "ok.txt/ft/cells/", "cli"),
    ("finetune", "--tasks default --tasks_dir {root}/ok.txt/tasks --seeds 1",
     "ok.txt/tasks/ner (Not a directory); choose another path", ""),
    ("analysis", "--analysis drift --ckpts {out},{out} --out_dir {root}/ok.txt/an", "ok.txt/an (Not a directory); give --out_dir", "cli"),
    ("analysis", "--analysis transplant --layers 0 --ckpts {out},{root}/clm_copy --tasks t=cls:{root}/good_task --seeds 1 "
     "--out_dir {root}/ok.txt/tp", "ok.txt/tp (Not a directory)", ""),
    # silent wrong results, refused: a label that is not finite, a tag no scheme here reads, strict scoring of gold
    # it would drop, one checkpoint named twice (its arms would write one cell), CKA on too few sentences
    ("finetune", "--tasks t=regression:{root}/nan_task --seeds 1", "nan_task/train.tsv:3: label should be a finite "
     "number, got 'nan'", "cli"),
    ("finetune", "--tasks t=ner:{root}/bilou_task --seeds 1", "bilou_task/train.tsv:1: tag 'U-DRUG' is neither O nor",
     ""),
    ("finetune", "--tasks t=ner:{root}/iob1_task --seeds 1 --ner_mode strict", "iob1_task/dev.tsv:3: this sentence's "
     "gold tags are not valid IOB2", ""),
    ("finetune", "--ckpts {out},{out}/ --seeds 1", "/clm/hf; list each once", ""),
    ("finetune", "--ckpts {out}/hf,{root}/clm_copy,{out} --seeds 1", "a checkpoint is listed twice", ""),
    ("analysis", "--analysis cka --ckpts {out},{root}/clm_copy --texts {root}/ok.txt", "holds 2 sentences; CKA needs "
     "at least 3", "cli"),
    ("finetune", "--tasks t=cls:{root}/good_task@2", "task t: max length @2 must be >= 3", ""),
    ("finetune", "--protocol paper-de", "--protocol 'paper-de' must be one of \"\" | paper-en | paper-fr", ""),
    ("finetune", "--ner_mode lenient", "--ner_mode 'lenient' must be one of default | strict", ""),
    ("finetune", "--selection cls=f1", "--selection 'cls=f1' must be kind=metric,..., each kind once (cls=macro_f1|", ""),
    ("finetune", "--selection cls=accuracy,cls=macro_f1", "--selection 'cls=accuracy,cls=macro_f1' must be", ""),
    # an option given that acts on nothing in this run: one line, the option named
    ("finetune", "--tasks t=cls:{root}/good_task --seeds 1 --probe_lr 0.1", "--probe_lr does not act in this run (no "
     "task is probed); drop it", "cli"),
    ("finetune", "--tasks t=cls:{root}/good_task --seeds 1 --ner_mode strict", "--ner_mode does not act in this run (no "
     "NER task)", ""),
    ("finetune", "--tasks t=cls:{root}/good_task --seeds 1 --pos_weight auto", "--pos_weight does not act in this run "
     "(no multilabel task)", ""),
    ("finetune", "--tasks t=cls:{root}/good_task --seeds 1 --selection ner=f1", "--selection does not act in this run "
     "(no ner task)", ""),
    ("finetune", "--tasks t=cls:{root}/good_task --seeds 1 --task_seed 7", "--task_seed does not act in this run (no "
     "default task", ""),
    ("finetune", "--tasks t=cls+probe:{root}/good_task --seeds 1 --epochs 2", "--epochs does not act in this run (no "
     "cls, multilabel or regression task trains)", ""),
    ("finetune", "--tasks t=cls:{root}/good_task@64 --seeds 1 --max_len 128", "--max_len does not act in this run "
     "(every task has its own @N)", ""),
    ("finetune", "--tasks t=cls+probe:{root}/good_task --seeds 1 --probe true", "--probe does not act in this run "
     "(every task is a probe already", ""),
    ("finetune", "--seeds 2 --cpu_seeds 4", "--cpu_seeds does not act in this run (--seeds is set, or this is not a "
     "CPU)", ""),
    ("finetune", "--merge true --shard 0/2", "--shard does not act in this run (--merge true merges every shard", ""),
    ("analysis", "--analysis drift --ckpts {out},{root}/clm_copy --epochs 3", "--epochs does not act in this run "
     "(--analysis drift reads only --analysis, --ckpts, --out_dir)", "cli"),
    ("analysis", "--analysis cka --ckpts {out},{root}/clm_copy --layers 0", "--layers does not act in this run", ""),
    ("analysis", "--analysis transplant --layers 0 --ckpts {out},{root}/clm_copy --tasks t=cls:{root}/good_task "
     "--seeds 1 --learning_rate 1e-3", "--learning_rate does not act in this run (every task is a probe", ""),
]
OUTPUTS = {"detour": "--data_dir {data} --out_dir {out} --overwrite true " + " ".join(TINY),
           "prepare": "--out_dir {data}",  # and --n_docs 50 where the corpus is generated
           "finetune": "--ckpts {out} --out_dir {out} --tasks_dir {data} --pretrain_dir {data} --progress false",
           "analysis": "--ckpts {out} --out_dir {out}"}  # the options every analysis reads
OUTPUTS["decay"] = "--out_dir {root}/decay --progress false"  # a decay takes its shape and Phase 1's keys from {out}
PROGRAMS["decay"] = PROGRAMS["detour"]


def outputs(program, args):
    """The options pointing a row's outputs at the existing dataset and checkpoint: the default tasks' directories
    only where the default tasks are read (elsewhere they act on nothing, and are refused)."""
    if program == "finetune" and "--tasks " in args and "--tasks default" not in args:
        return OUTPUTS[program].replace(" --tasks_dir {data} --pretrain_dir {data}", "")
    return OUTPUTS[program]


@pytest.mark.parametrize("program,args,message,cli", ROWS)
def test_bad_input_is_one_line_and_changes_nothing(env, program, args, message, cli):
    before = snapshot(env["data"], env["out"])
    argv = (outputs(program, args) + " " + args).format(**env).split()
    if cli:
        r = subprocess.run([sys.executable, os.path.join(ROOT, PROGRAMS[program][1]), *argv], cwd=env["root"],
                           capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        line = r.stderr.strip()
    else:
        with pytest.raises(SystemExit) as e:
            PROGRAMS[program][0](argv)
        line = str(e.value.code)
    assert line.startswith("error: ") and "\n" not in line and "; " in line and message in line, line
    assert snapshot(env["data"], env["out"]) == before


def test_a_missing_dataset_names_the_command_that_builds_it(tmp_path):
    data = str(tmp_path / "pubmed")
    with pytest.raises(SystemExit) as e:
        detour.main(["--data_dir", data, "--out_dir", str(tmp_path / "clm"), *TINY])
    line = str(e.value.code)
    assert line == (f"error: {data}/meta.json not found; run `python data/prepare.py --input FILES --out_dir {data}` "
                    "(without --input: a generated corpus), or set --data_dir")
    assert os.listdir(tmp_path) == []  # nothing written, no out_dir
    # The hinted command, FILES given, builds that very directory, and detour reads it.
    open(tmp_path / "abstracts.txt", "w").write("".join(f"abstract {i}: aspirin lowered the risk.\n" for i in range(60)))
    command = line.split("`")[1].replace("FILES", str(tmp_path / "abstracts.txt")).split()
    r = subprocess.run([sys.executable, *command[1:], "--vocab_size", "300"], cwd=ROOT,
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert r.returncode == 0, r.stderr
    meta, train = detour.load_data(data, "train")
    assert meta["n_train_tokens"] == len(train) > 0


@pytest.mark.parametrize("bad,value,cli", [("ID", "3%4", "cli"), ("ID", None, ""), ("MIN", "one", ""),
                                           ("COUNT", "", "")])
def test_a_slurm_array_variable_that_is_not_a_number_is_one_line(env, monkeypatch, bad, value, cli):
    """finetune.py in a SLURM job array takes its shard from $SLURM_ARRAY_TASK_ID - _MIN / _COUNT (test_grid); one that
    is not a number (or an ID unset) is the one-line error naming it, as a bad --shard is, not int()'s traceback."""
    for key, ok in (("ID", "3"), ("MIN", "1"), ("COUNT", "4")):
        monkeypatch.setenv("SLURM_ARRAY_TASK_" + key, ok)
    if value is None:
        monkeypatch.delenv("SLURM_ARRAY_TASK_" + bad)
    else:
        monkeypatch.setenv("SLURM_ARRAY_TASK_" + bad, value)
    test_bad_input_is_one_line_and_changes_nothing(
        env, "finetune", "", f"$SLURM_ARRAY_TASK_{bad} is {value or ''!r}, not a number; give --shard i/n", cli)


@pytest.mark.parametrize("program,flag", [("detour.py", "--help"), ("finetune.py", "-h"), ("data/prepare.py", "-h"),
                                          ("studies/analysis.py", "--help")])
def test_help_lists_every_option_with_its_default_and_comment(program, flag):
    r = subprocess.run([sys.executable, os.path.join(ROOT, program), flag], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    options = {"detour.py": dict(detour.DEFAULTS), "finetune.py": vars(ft.Protocol()),
               "studies/analysis.py": vars(analysis.Analysis()),  # its own options and finetune.py's
               "data/prepare.py": dict(vocab_size=8192, n_docs=prepare.DEFAULT_N_DOCS, val_fraction=0.005)}[program]
    for key in options:
        assert f"{key}" in r.stdout, key
    if program == "detour.py":
        assert 'dtype = "auto"             # auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16' in r.stdout
        assert "# optimizer (decoupled AdamW)" in r.stdout and "---" not in r.stdout
    if program == "finetune.py":
        assert 'pooling: str = "mean"           # cls | mean' in r.stdout and "# protocol (paper)" in r.stdout
        assert '"paper-en": dict(learning_rate=5e-5' in r.stdout and '"paper-fr": dict(' in r.stdout  # --protocol
    if program == "studies/analysis.py":
        assert 'layers: str = ""    # transplant: the group taken from the first checkpoint' in r.stdout
        assert r.stdout.startswith("usage: python studies/analysis.py [--key value")
