"""
studies/analysis.py: why does the detour work? The paper's analyses of the checkpoints that
finetune.py compares, built on its functions.

  python studies/analysis.py --analysis cka --ckpts out/clm-decay,out/mlm-decay,out/mlm-s18-decay
  python studies/analysis.py --analysis drift --ckpts out/clm-decay,out/clm   # checkpoint, its init
  python studies/analysis.py --analysis transplant --ckpts out/clm-decay,out/mlm-decay --layers 0-1

  cka         d = 1 - linear CKA per layer between A and B on held-out sentences (--texts); a
              third checkpoint C, B's seed twin, adds r = d(A, B) / d(B, C)
  drift       where the detour moved the weights: ||W - W0|| / ||W0|| per layer, attention and
              MLP apart
  transplant  which layers carry the gain: a layer group (0-7, attn or mlp) of A put into B,
              linear-probed

Layers are numbered from 0, as in --freeze_layers. Results: <out_dir>/cka.md, drift.md or
transplant-<layers>.md, each with its .json. Every finetune.py option applies too (a transplant's
probes are a finetune.py grid, under its CPU default); --help lists them all.
"""
import copy
import math
import os
import re
import sys
from dataclasses import dataclass, replace

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not __package__:  # run as a file (python studies/analysis.py): the repository root, for finetune
    sys.path.insert(0, ROOT)
import detour  # noqa: E402
import finetune  # noqa: E402
from data import tasks  # noqa: E402  (read_lines: a text file's lines, checked)
from detour import fail  # noqa: E402


# ----------------------------------------------------------------------------------------
# The options: finetune.py's Protocol, and these.
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Analysis(finetune.Protocol):
    ckpts: str = "out/clm-decay,out/mlm-decay"  # A,B[,C]: the twins (finetune.py's θ0 row is no
                                                # seed-noise control)
    analysis: str = ""  # cka | drift | transplant
    texts: str = ""     # cka: one text per line; "" = <pretrain_dir>/val.txt (held-out text)
    layers: str = ""    # transplant: the group taken from the first checkpoint: 0-7 | 0-3,10
                        # | attn | mlp | embeddings,0

RULES = dict(finetune.RULES, analysis=detour.one_of("cka", "drift", "transplant"))
PROG = "studies/analysis.py"


# ----------------------------------------------------------------------------------------
# cka: how differently two checkpoints represent the same sentences, layer by layer.
# ----------------------------------------------------------------------------------------
def centered(a):
    """Columns minus their means, float64. Of inputs all the same, centering leaves rounding alone
    (~1e-16 of them), on which CKA would compute a number: zeros instead."""
    a = np.asarray(a, np.float64)
    c = a - np.mean(a, 0)
    return c if np.linalg.norm(c) > 1e-9 * np.linalg.norm(a) else np.zeros_like(c)


def linear_cka(x, y):
    """Linear CKA (Kornblith et al., 2019) of two representations x (n, p), y (n, q) of the same n
    inputs: ||Y'X||^2 / (||X'X|| ||Y'Y||) of the centered columns; 1 = the same up to a rotation
    and a scale, near 0 = unrelated. Float64: the terms are fourth powers of the activations."""
    x = centered(x)
    y = centered(y)
    denominator = np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y)
    if not denominator > 0:  # a side the same for every input (or not finite): undefined
        return float("nan")
    return float(np.linalg.norm(y.T @ x) ** 2 / denominator)


# With n inputs the centered features span n - 1 directions: with 2, each side's is one direction,
# and linear CKA is 1 whatever the checkpoints; from 3 on it measures something.
MIN_TEXTS = 3


def text_examples(protocol, tokenizer, path):
    """A text file -> examples {ids}: each sentence of each line as [CLS] sentence [SEP], cut into
    chunks of max_len. Sentences, not lines: CKA needs many more inputs than hidden dimensions."""
    cls = tokenizer.token_to_id("[CLS]")
    sep = tokenizer.token_to_id("[SEP]")
    room = protocol.max_len - 2
    out = []
    for line in tasks.read_lines(path):
        for sentence in re.split(r"(?<=[.!?])\s+", line.strip()):
            ids = tokenizer.encode(sentence, add_special_tokens=False).ids
            out += [dict(ids=[cls] + ids[s:s + room] + [sep]) for s in range(0, len(ids), room)]
    if len(out) < MIN_TEXTS:
        fail(f"{path} holds {len(out)} sentences; CKA needs at least {MIN_TEXTS} (with fewer it is "
             "1, d = 0, whatever the checkpoints): give --texts more sentences")
    return out


def layer_features(protocol, model, examples):
    """Every example's hidden states mean-pooled over its real tokens, at the embedding output and
    after each layer -> L + 1 float64 arrays (n, d); bidirectional, as the encoder is used
    downstream."""
    dev = finetune.get_device(protocol)
    body = model.model.to(dev)

    def pooled(idx):  # (B, L + 1, d); float64, which autocast leaves alone
        batch = [examples[i] for i in idx]
        ids, mask, _ = tasks.pad_batch(batch, body.config.pad_token_id, dev)
        m = mask.unsqueeze(-1).double()
        hidden = body(ids, attention_mask=mask, output_hidden_states=True)[1]
        return torch.stack([(h.double() * m).sum(1) / m.sum(1) for h in hidden], 1)
    per_example = finetune.per_example(protocol, body, examples, dev, pooled)
    return [f.numpy() for f in torch.stack(per_example, 1)]


def same_tokenizer(tokenizers, paths):
    if any(t.get_vocab() != tokenizers[0].get_vocab() for t in tokenizers):
        fail(f"{', '.join(paths)} do not share one tokenizer; "
             "the analysis feeds them the same token ids")


def cka_features(protocol, paths, text_path):
    """Each checkpoint's layer_features on the sentences of text_path -> (features, examples)."""
    feats = []
    tokenizers = []
    examples = None
    for path in paths:
        model, tokenizer = detour.load_encoder(path)
        tokenizers.append(tokenizer)
        same_tokenizer(tokenizers, paths)
        examples = examples or text_examples(protocol, tokenizer, text_path)
        print(f"cka: {path} on {len(examples)} sentences of {text_path}")
        feats.append(layer_features(protocol, model, examples))
    if len({len(f) for f in feats}) > 1:
        fail(f"{', '.join(paths)} differ in depth; CKA is compared layer by layer")
    return feats, examples


def cka_divergence(protocol, paths, text_path=None):
    """d = 1 - linear CKA between checkpoints A and B on held-out sentences, at the embedding
    output and after every layer. A third checkpoint C, B's seed-noise control (B's objective,
    another seed), adds d(B, C) and r = d(A, B) / d(B, C): how many times seed noise A and B
    differ."""
    if len(paths) not in (2, 3):
        fail("--analysis cka needs --ckpts A,B or A,B,C (C: B's twin trained with another seed)")
    text_path = text_path or protocol.texts or os.path.join(protocol.pretrain_dir, "val.txt")
    if not os.path.isfile(text_path):
        fail(f"{text_path} is not a file; pass --texts (a file, one text per line) "
             "or run data/prepare.py")
    feats, examples = cka_features(protocol, paths, text_path)
    width = feats[0][0].shape[1]
    if len(examples) <= width:  # said, not refused: a real model's width may exceed a texts file
        print(f"note: {len(examples)} sentences for {width} dimensions: with fewer inputs than "
              "dimensions linear CKA is biased toward 1 (d toward 0); give --texts more sentences")

    names = ["embeddings"] + [f"layer {i}" for i in range(len(feats[0]) - 1)]

    def d(i, j, layer):  # CKA <= 1 (Cauchy-Schwarz): max() only hides rounding below 0
        cka = linear_cka(feats[i][layer], feats[j][layer])
        if math.isnan(cka):  # max(0.0, nan) would print 0
            fail(f"CKA at the {names[layer]} of {paths[i]} and {paths[j]} is undefined: one gives "
                 "every sentence the same features there, or features that are not finite; give "
                 "--texts sentences that differ")
        return max(0.0, 1 - cka)
    rows = [dict(layer=name, d_ab=d(0, 1, layer)) for layer, name in enumerate(names)]
    for layer, row in enumerate(rows if len(paths) == 3 else []):
        row["d_bc"] = d(1, 2, layer)
        row["r"] = row["d_ab"] / row["d_bc"] if row["d_bc"] > 0 else None
    results = dict(checkpoints=dict(zip("ABC", paths)), texts=text_path, n_texts=len(examples),
                   max_len=protocol.max_len, rows=rows)
    return finetune.write_report(protocol, "cka", results, cka_markdown(results))


def cka_markdown(results):
    """A row per layer; the columns of C only with C."""
    control = "C" in results["checkpoints"]
    head = ["layer", "d(A, B)"]
    if control:
        head += ["d(B, C)", "r = d(A, B) / d(B, C)"]

    def cells(row):
        out = [row["layer"], f"{row['d_ab']:.4f}"]
        if control:
            out += [f"{row['d_bc']:.4f}", "—" if row["r"] is None else f"{row['r']:.2f}"]
        return out
    lines = finetune.md_table(head, [cells(row) for row in results["rows"]])
    lines += [""] + [f"{k}: {path}" for k, path in results["checkpoints"].items()]
    lines.append(f"d = 1 - linear CKA of mean-pooled hidden states (padding excluded) on "
                 f"{results['n_texts']} sentences of {results['texts']}; "
                 "layer i = the output of layer i.")
    if control:
        lines.append("r > 1: A and B differ by more than two seeds of B's objective do.")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------
# drift: where the detour moved the weights.
# ----------------------------------------------------------------------------------------
def part_of(name):
    """A parameter name -> (part, layer): ("attn", i) for layer i's Wqkv, Wo, attn_norm, ("mlp", i)
    for its Wi, Wo, mlp_norm, ("embeddings", None), or ("head", None): the final norm and MLM
    head."""
    m = re.match(r"model\.layers\.(\d+)\.(attn|mlp)", name)  # also matches attn_norm, mlp_norm
    if m:
        return m.group(2), int(m.group(1))
    return ("embeddings" if name.startswith("model.embeddings.") else "head"), None


def shapes(model):
    return {name: tuple(w.shape) for name, w in model.named_parameters()}


def same_shapes(a, b, paths):
    if shapes(a) != shapes(b):
        fail(f"{paths[0]} and {paths[1]} do not have the same architecture "
             "(parameter names and shapes)")


def ratio(d2, b2):
    """sqrt(||W - W0||^2 / ||W0||^2); None where W0 = 0 (a zero-initialized bias)."""
    return math.sqrt(d2 / b2) if b2 else None


def weight_drift(model, init):
    """Relative Frobenius change ||W - W0|| / ||W0|| of `model` from `init` per part (part_of; its
    tensors as one W), and per tensor: a norm's gain (1 at init, norm sqrt(d)) weighs as much as a
    std-0.02 matrix of d^2 entries. -> ({(part, layer): change}, {parameter name: change})"""
    start = dict(init.named_parameters())
    sums = {}
    tensors = {}
    for name, w in model.named_parameters():
        w0 = start[name].detach().double()
        d2 = float(((w.detach().double() - w0) ** 2).sum())
        b2 = float((w0 ** 2).sum())
        tensors[name] = ratio(d2, b2)
        s = sums.setdefault(part_of(name), [0.0, 0.0])
        s[0] += d2
        s[1] += b2
    return {k: ratio(*s) for k, s in sums.items()}, tensors


def bar(x, top, width=24):
    """x as a bar of eighth blocks; `top` fills `width` characters."""
    eighths = round(8 * width * x / top) if top > 0 else 0
    return ("█" * (eighths // 8) + " ▏▎▍▌▋▊▉"[eighths % 8]).rstrip().ljust(width)


def drift(protocol, paths):
    """weight_drift of checkpoint A from B, its initialization (or any earlier checkpoint of the
    same shape)."""
    if len(paths) != 2:
        fail("--analysis drift needs --ckpts CHECKPOINT,INIT")
    # weights only: no tokenizer needed
    model, init = (detour.load_hf(detour.hf_dir(path)) for path in paths)
    same_shapes(model, init, paths)
    d, tensors = weight_drift(model, init)
    layers = [dict(layer=i, attn=d[("attn", i)], mlp=d[("mlp", i)])
              for i in range(model.config.num_hidden_layers)]
    results = dict(checkpoint=paths[0], init=paths[1], embeddings=d[("embeddings", None)],
                   layers=layers, head=d[("head", None)], tensors=tensors)
    return finetune.write_report(protocol, "drift", results, drift_markdown(results))


def drift_markdown(results):
    """Every part as a number and a bar (one scale for all), then as a table."""
    emb = results["embeddings"]
    head = results["head"]
    layers = results["layers"]
    top = max([emb, head] + [r[k] for r in layers for k in ("attn", "mlp")])

    def show(x):
        return f"{x:.4f} {bar(x, top)}"
    chart = [f"embeddings    {show(emb)}"]
    chart += [f"layer {r['layer']:2d} attn {show(r['attn'])}  mlp {show(r['mlp'])}" for r in layers]
    chart.append(f"head          {show(head)}")
    table = ["| part | attention | MLP |", "|---|---|---|", f"| embeddings | {emb:.4f} | |"]
    table += [f"| layer {r['layer']} | {r['attn']:.4f} | {r['mlp']:.4f} |" for r in layers]
    table.append(f"| final norm + MLM head | {head:.4f} | |")
    title = (f"Weight drift of {results['checkpoint']} from {results['init']}: ||W - W0|| / ||W0|| "
             "per part (attention = Wqkv, Wo, attn_norm; MLP = Wi, Wo, mlp_norm).")
    return "\n".join([title, "", "```", *[c.rstrip() for c in chart], "```", "", *table]) + "\n"


# ----------------------------------------------------------------------------------------
# transplant: which layers carry the gain.
# ----------------------------------------------------------------------------------------
def chosen_layers(spec, n_layers):
    """Layers like 0-7, 0-3,10, "embeddings" among them -> [indices] (+ "embeddings"); [] if bad."""
    parts = spec.replace(" ", "").split(",")
    try:
        chosen = detour.parse_layers(",".join(q for q in parts if q != "embeddings"), n_layers)
    except SystemExit:  # parse_layers' message names --freeze_layers
        return []
    return chosen + (["embeddings"] if "embeddings" in parts else [])  # part_of's name for them


def group_names(model, spec):
    """A layer group's parameters: attn or mlp (that module of every layer, with its norm) or layers
    0-7, 0-3,10, where "embeddings" may stand among the layers (embeddings,0: the embeddings and
    layer 0)."""
    names = [name for name, _ in model.named_parameters()]
    n_layers = model.config.num_hidden_layers
    if spec in ("attn", "mlp"):
        return [n for n in names if part_of(n)[0] == spec]
    chosen = chosen_layers(spec, n_layers)
    if not chosen:
        fail(f"--layers {spec!r} should be attn, mlp or layers like 0-7, 0-3,10 or embeddings,0 "
             f"(the model has {n_layers}, from 0)")
    return [n for n in names if part_of(n)[1] in chosen or part_of(n)[0] in chosen]


def transplant_model(donor, recipient, spec):
    """A copy of `recipient` whose layer group `spec` (see group_names) holds `donor`'s weights."""
    hybrid = copy.deepcopy(recipient)
    source = dict(donor.named_parameters())
    hybrid.load_state_dict({name: source[name] for name in group_names(recipient, spec)},
                           strict=False)
    return hybrid


def transplant(protocol, paths, spec, task_specs):
    """The hybrids of checkpoints A, B (layer group `spec` from A, the rest from B; A1+A2,B1+B2: one
    hybrid per replicate pair), saved as HF dirs in out_dir and linear-probed next to A and B: a
    probe keeps the encoder frozen, where fine-tuning would retrain the transplanted layers and
    blur what they carry."""
    arms = finetune.arms_of(paths)
    if len(arms) != 2:
        fail("--analysis transplant needs --ckpts A,B (the layers come from A, the rest from B)")
    name = "transplant-" + spec.replace(",", "_")
    hybrids = [os.path.join(protocol.out_dir, name)]
    if len(arms[0]) > 1:
        hybrids = [os.path.join(protocol.out_dir, name, f"r{k + 1}") for k in range(len(arms[0]))]
    for path_a, path_b, hybrid_dir in zip(*arms, hybrids):
        a, tokenizer_a = detour.load_encoder(path_a)
        b, tokenizer_b = detour.load_encoder(path_b)
        same_tokenizer([tokenizer_a, tokenizer_b], [path_a, path_b])
        same_shapes(a, b, [path_a, path_b])
        # a hybrid_dir that cannot be written: one line (save_hf's make_dirs and atomic_write)
        detour.save_hf(transplant_model(a, b, spec), hybrid_dir,
                       os.path.join(detour.hf_dir(path_b), "tokenizer.json"))
    note = (f"{'+'.join(hybrids)}: layers {spec} from {paths[0]}, the rest from {paths[1]} "
            "(linear probes)")
    return finetune.run(replace(protocol, probe=True), [paths[0], "+".join(hybrids), paths[1]],
                        task_specs, report=name, note=note)


# ----------------------------------------------------------------------------------------
# The command line.
# ----------------------------------------------------------------------------------------
def print_help():
    """This file's options, then finetune.py's (every one of them applies here too)."""
    def block(path, start, end):
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            return start + f.read().split(start, 1)[1].split(end)[0].rstrip()
    print(f"usage: python {PROG} [--key value | --key=value ...]; every option, its default and "
          "comment: this file's, then finetune.py's\n")
    print(block(PROG, "class Analysis", "\nRULES"))
    print("\n# finetune.py's options:")
    print(block("finetune.py", "class Protocol", "\nCPU_DEFAULTS"))
    raise SystemExit(0)


# What cka and drift read besides --analysis, --ckpts and --out_dir; every other option is refused
# there (they fine-tune nothing). A transplant probes: finetune.py's rules, every task a probe.
READS = {"cka": {"texts", "pretrain_dir", "max_len", "batch_size", "device", "dtype"},
         "drift": set()}


def idle_options(protocol, given, paths):
    """The options given that act on nothing in this analysis -> {key: why}."""
    if protocol.analysis in READS:
        reads = READS[protocol.analysis] | {"analysis", "ckpts", "out_dir"}
        if protocol.texts:
            reads.discard("pretrain_dir")  # its val.txt is the texts' default
        why = f"--analysis {protocol.analysis} reads only --{', --'.join(sorted(reads))}"
        return {key: why for key in given if key not in reads}
    arms = finetune.arms_of(paths)
    specs = tasks.parse_tasks(protocol.tasks, protocol.tasks_dir)
    probes = replace(protocol, probe=True)
    idle = finetune.idle_options(probes, given, specs, arms[:1] * 3)  # A, the hybrid, B
    for key in ("probe", "texts"):
        if key in given:
            idle[key] = "a transplant probes every task, and reads no --texts"
    return idle


def main(argv=None):
    """The command line -> one Analysis (defaults, --key overrides) -> the analysis' results."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print_help()
    protocol, given = finetune.protocol_of(argv, Analysis, RULES, PROG)
    paths = finetune.listed(protocol.ckpts)
    if protocol.analysis == "transplant" and not protocol.layers:
        fail("--analysis transplant needs --layers (e.g. 0-7, attn or mlp)")
    if protocol.analysis == "transplant":  # no fine-tuning elsewhere: the CPU default is its own
        protocol = finetune.cpu_default(protocol, given)
    finetune.refuse_idle(idle_options(protocol, given, paths))
    if protocol.analysis == "cka":
        return cka_divergence(protocol, paths)
    if protocol.analysis == "drift":
        return drift(protocol, paths)
    return transplant(protocol, paths, protocol.layers, protocol.tasks)


if __name__ == "__main__":
    main()
