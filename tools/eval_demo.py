#!/usr/bin/env python3
"""Held-out figures for the bundled demo model (tools/train_demo.py --eval calls `evaluate`).

On a fixed sample of the held-out stdlib files (every 20th sorted file is never trained on):

  budget      the smallest RAM budget of 18%, 25%, 35%, 40%, 50% the model's working set fits (a model this small
              spends a large share of its bytes on the embedding and head, which stay resident)
  perplexity  per token, of the model through the engine (`Engine.logits`, at that budget) on 128-token
              windows (the training length), against an add-one smoothed unigram model of the training files'
              tokens, on exactly the same predicted tokens
  mtp         greedy decoding after held-out code prompts (the text up to a function header) with the MTP
              drafter at depths 1-3, chains (width 1): mean tokens per target forward, acceptance per depth,
              and whether the output is identical to plain decoding (spec "off")
  prefetch    decode at that budget with prefetch on: recall (routed experts that had been predicted) and
              precision of the engine's predictor (router lookahead + frequency prior), and of each part alone;
              adaptive shut-off disabled so every step is scored; decode steps only (prefill excluded)
  sample      a held-out function header completed with engine.generate(prompt, max_new_tokens=48); every
              plain completion is checked to parse as Python once cut at its last complete line

Writes eval.json and README.md (the model card) into the model folder and prints a table.

  python tools/train_demo.py --eval --out offload_engine/data/demo-model   # about 2-4 min on 2 CPU cores
"""
from __future__ import annotations

import ast
import json
import math
import re
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from offload_engine import Budget, Engine, EngineConfig  # noqa: E402
from offload_engine.assemble import assemble  # noqa: E402
from offload_engine.errors import BudgetError  # noqa: E402
from offload_engine.config import PrefetchConfig  # noqa: E402
from offload_engine.generate.decoder import FinishEvent, GenerationState, drive  # noqa: E402
from offload_engine.generate.sampling import Sampler, SamplingParams  # noqa: E402
from offload_engine.speculative.stepper import make_stepper  # noqa: E402

EOT = "<|endoftext|>"
FILES = 20  # held-out files sampled (evenly spaced in sorted order)
WINDOW = 128  # tokens of context per perplexity window (the training sequence length)
WINDOWS_PER_FILE = 2
PROMPTS = 12  # code prompts (one function header per file, from the first files with one)
PROMPT_CHARS = 600  # text before the header kept in a prompt
NEW_TOKENS = 48
DEPTHS = (1, 2, 3)
BUDGETS = ("18%", "25%", "35%", "40%", "50%")  # RAM budgets tried in order: the first the model's working set fits
COMMAND = "python tools/train_demo.py --eval --out offload_engine/data/demo-model"
HEADER = re.compile(r"^[ \t]*def \w+\(.*\)(\s*->\s*[^:]+)?:[ \t]*$", re.M)  # one-line function headers


# ---- data ---------------------------------------------------------------------------------------------------
def sample_files(held_out: Sequence[Path], n: int = FILES, min_chars: int = 2000) -> list[Path]:
    """n files evenly spaced over the sorted held-out list, skipping near-empty ones (__init__.py and the like)."""
    usable = [f for f in sorted(held_out) if f.stat().st_size >= min_chars]
    if len(usable) <= n:
        return usable
    return [usable[i * len(usable) // n] for i in range(n)]


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def code_prompts(files: Sequence[Path], n: int = PROMPTS) -> list[dict[str, str]]:
    """One prompt per file: up to PROMPT_CHARS of text (whole lines) before a function header in the middle of
    the file, then the header line without its newline (byte-level BPE merges a newline with the next line's
    indentation: a prompt ending in a bare newline ends on a token the model rarely saw there). `body` is what
    the file really has next."""
    out = []
    for f in files:
        text = read(f)
        headers = [m for m in HEADER.finditer(text) if m.start() >= 200]
        if not headers:
            continue
        m = headers[len(headers) // 2]
        start = text.rfind("\n", 0, max(0, m.start() - PROMPT_CHARS)) + 1
        end = m.end()
        out.append({"file": f.name, "prompt": text[start:end], "header": m.group(0), "body": text[end:end + 300]})
        if len(out) == n:
            break
    return out


# ---- budget -------------------------------------------------------------------------------------------------
def pick_budget(path: Path, max_context: int) -> tuple[str, str]:
    """The first of BUDGETS the engine can run in (embedding, head, one streaming slot per unit kind, KV cache
    and staging must fit), and why smaller ones were refused."""
    refused = []
    for budget in BUDGETS:
        try:
            Engine.open(path, budget=Budget(ram=budget), max_context=max_context).close()
            return budget, "; ".join(refused)
        except BudgetError as e:
            refused.append(f"{budget}: need {e.required:,} bytes, have {e.available:,}")
    raise BudgetError("host", 0, 0, hint=f"none of {BUDGETS} fits: " + "; ".join(refused))


# ---- perplexity ---------------------------------------------------------------------------------------------
def unigram_log_probs(tok, train_files: Sequence[Path], vocab: int, cap: int) -> tuple[torch.Tensor, int]:
    """log p(token) from the training files' token counts (the training stream: files joined by EOT), add-one
    smoothed over the model's vocabulary."""
    from tools.train_demo import read_texts

    eot = tok.token_to_id(EOT)
    counts = torch.zeros(vocab, dtype=torch.float64)
    total = 0
    for enc in tok.encode_batch(read_texts(list(train_files), cap)):
        ids = torch.tensor(enc.ids + [eot], dtype=torch.long)
        counts += torch.bincount(ids, minlength=vocab)[:vocab].double()
        total += ids.numel()
    return torch.log((counts + 1.0) / (total + vocab)), total


def windows(ids: list[int], k: int = WINDOWS_PER_FILE, size: int = WINDOW) -> list[list[int]]:
    """Up to k windows of size + 1 tokens (size predicted), evenly spaced over the file."""
    if len(ids) < 2:
        return []
    if len(ids) <= size + 1:
        return [ids]
    last = len(ids) - size - 1
    starts = sorted({round(i * last / max(k - 1, 1)) for i in range(k)})
    return [ids[s:s + size + 1] for s in starts]


def perplexity(engine: Engine, tok, files: Sequence[Path], unigram: torch.Tensor) -> dict[str, Any]:
    eot = tok.token_to_id(EOT)
    nll_model = nll_uni = 0.0
    tokens = 0
    per_file = []
    for f in files:
        text = read(f)
        ids = tok.encode(text).ids + [eot]
        fm = fu = 0.0
        n = 0
        for w in windows(ids):
            logits = engine.logits(w[:-1])
            target = torch.tensor(w[1:], dtype=torch.long)
            fm += float(F.cross_entropy(logits, target, reduction="sum"))
            fu += float(-unigram[target].sum())
            n += target.numel()
        nll_model, nll_uni, tokens = nll_model + fm, nll_uni + fu, tokens + n
        per_file.append({"file": f.name, "tokens": n, "model_ppl": math.exp(fm / n), "unigram_ppl": math.exp(fu / n)})
    return {"tokens": tokens, "files": len(files), "window": WINDOW,
            "model_ppl": math.exp(nll_model / tokens), "unigram_ppl": math.exp(nll_uni / tokens),
            "model_nats_per_token": nll_model / tokens, "unigram_nats_per_token": nll_uni / tokens,
            "per_file": per_file}


# ---- MTP speculative decoding -------------------------------------------------------------------------------
def decode(engine: Engine, ids: list[int], spec: str, depth: int | None = None):
    """Greedy, NEW_TOKENS, through make_stepper; returns (token ids, stepper, decode seconds)."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    cache = engine.model.new_cache(len(ids) + NEW_TOKENS + 8)
    stepper = make_stepper(engine.model, cache, Sampler(params), spec, depth=depth, width=1 if depth else None,
                           store=engine.store, tokenizer=engine.tokenizer)
    events = list(drive(stepper, ids, GenerationState(params, engine.tokenizer)))
    finish = events[-1]
    assert isinstance(finish, FinishEvent)
    return finish.token_ids, stepper, finish.decode_s


def mtp_acceptance(engine: Engine, prompts: list[list[int]], depths: Sequence[int]
                   ) -> tuple[dict[str, Any], list[list[int]]]:
    """Figures per depth, and the plain (spec "off") outputs every depth's must equal."""
    plain, plain_s = [], 0.0
    decode(engine, prompts[0], "off")  # warm-up: first-call allocations are nobody's decode time
    for ids in prompts:
        out, _, s = decode(engine, ids, "off")
        plain.append(out)
        plain_s += s
    steps_plain = sum(len(o) - 1 for o in plain)
    result: dict[str, Any] = {"prompts": len(prompts), "new_tokens": NEW_TOKENS,
                              "off": {"decode_tok_s": steps_plain / plain_s}, "depths": {}}
    for depth in depths:
        hist = [0] * (depth + 1)
        steps = spec_steps = accepted = drafted = forwards = 0
        same, seconds = True, 0.0
        for ids, want in zip(prompts, plain):
            out, stepper, s = decode(engine, ids, "mtp", depth)
            st = stepper.stats
            same &= out == want
            seconds += s
            steps, spec_steps, forwards = steps + st.steps, spec_steps + st.spec_steps, forwards + st.target_forwards
            accepted, drafted = accepted + st.accepted, drafted + st.drafted
            for a, c in enumerate(st.accept_hist):
                hist[a] += c
        # acceptance at depth d: P(draft d accepted | drafts 1..d-1 accepted), from steps by accepted count
        reached = [sum(hist[d:]) for d in range(depth + 1)]
        rates = [reached[d] / reached[d - 1] if reached[d - 1] else 0.0 for d in range(1, depth + 1)]
        result["depths"][str(depth)] = {
            "tokens_per_forward": (accepted + spec_steps) / max(spec_steps, 1),  # accepted drafts + the target's
            "mean_accepted": accepted / max(spec_steps, 1),
            "acceptance_per_depth": rates,
            "accept_hist": hist,
            "draft_tokens": drafted, "accepted_tokens": accepted, "spec_steps": spec_steps,
            "decode_forwards": steps, "target_forwards": forwards,
            "generated_per_decode_forward": steps_plain / max(steps, 1),  # ends included (a cut last step)
            "identical_to_plain": same,
            "decode_tok_s": steps_plain / seconds,
        }
    return result, plain


def parses_as_python(header: str, completion: str) -> tuple[int, int]:
    """(lines of the completion that parse after the header, complete lines generated): header + completion
    cut at its last newline, then shortened a line at a time until it parses. A cut completion is unfinished,
    not wrong: a closing triple quote may end an open (doc)string, and a `pass` an empty body or a trailing
    block opener."""
    first, *lines = (header + completion).split("\n")
    lines = lines[:-1]  # complete lines only
    for keep in range(len(lines), -1, -1):
        snippet = "\n".join([first, *lines[:keep]])
        for tail in ("", PASS, '"""', "'''", '"""' + PASS, "'''" + PASS):
            try:
                ast.parse(textwrap.dedent(_indent_tail(snippet + tail)))
                return keep, len(lines)
            except SyntaxError:
                continue
    return 0, len(lines)


PASS = "\n" + " " * 64 + "pass"  # re-indented by _indent_tail


def _indent_tail(snippet: str) -> str:
    """Give a trailing `pass` the indentation of a block opener's body (one level deeper than the last line)."""
    if not snippet.endswith("pass"):
        return snippet
    body, _, _ = snippet.rpartition("\n")
    last = body.rstrip("\n").rsplit("\n", 1)[-1]
    return body + "\n" + " " * (len(last) - len(last.lstrip()) + 4) + "pass"


# ---- prefetch recall ----------------------------------------------------------------------------------------
def _engine(path: Path, budget: str, context: int, prefetch: PrefetchConfig, which: str) -> Engine:
    """An engine whose prefetcher predicts with one part of the engine's predictor ("lookahead", "prior") or with
    all of it ("combined", the engine's own)."""
    config = EngineConfig(budget=Budget(ram=budget), max_context=context, prefetch=prefetch)
    return Engine(assemble(path, config, predictor=which))


def prefetch_budgets(path: Path, budget: str, context: int) -> list[str]:
    """`budget`, and when the dense units (which hold the routers) stream at it, also the first larger budget of
    BUDGETS that pins them: the router lookahead scores with a layer's dense unit (its router), which then has
    to arrive in time (the prefetcher reads dense units one layer beyond the expert horizon)."""
    out = [budget]
    for b in BUDGETS[BUDGETS.index(budget):]:
        with Engine.open(path, budget=Budget(ram=b), max_context=context) as engine:
            if engine.placement.home("dense") != "disk":
                return out + [b] if b != budget else out
    return out


def prefetch_recall(path: Path, prompts: list[list[int]], budget: str, context: int) -> dict[str, Any]:
    # keep predicting: every decode step is scored (route ahead off: forwards that route ahead skip these predictors)
    config = PrefetchConfig(adaptive=False, route_ahead=0)
    out: dict[str, Any] = {"budget": budget, "adaptive": False, "prompts": len(prompts)}
    for which in ("lookahead", "prior", "combined"):
        with _engine(path, budget, context, config, which) as engine:
            out["homes"] = {kind: engine.placement.home(kind) for kind in engine.placement.sizes}
            pf = engine.model.prefetcher
            if pf is None:
                return {**out, "note": "every unit pinned at this budget: nothing to prefetch"}
            predicted = routed = hit = 0
            before = engine.snapshot()
            for ids in prompts:
                m0 = None
                for event in engine.stream(ids, max_new_tokens=NEW_TOKENS, ignore_eos=True):
                    if m0 is None:  # the prefill's token: decode starts here
                        m0 = (pf.metrics.predicted, pf.metrics.routed, pf.metrics.hit)
                    if isinstance(event, FinishEvent):
                        summary = event.stats["prefetch"]
                predicted += pf.metrics.predicted - m0[0]
                routed += pf.metrics.routed - m0[1]
                hit += pf.metrics.hit - m0[2]
            after = engine.snapshot()
            spec = engine.model.spec
            decode_tokens = len(prompts) * (NEW_TOKENS - 1)
            out[which] = {
                "recall": hit / routed if routed else 0.0, "precision": hit / predicted if predicted else 0.0,
                "predicted_per_routed": predicted / routed if routed else 0.0,
                "chance_recall": min(1.0, predicted / routed * spec.num_experts_per_tok / spec.num_experts)
                if routed else 0.0,
                "routed": routed, "predicted": predicted, "hit": hit,
                "engine_summary_all_forwards": {k: v for k, v in summary.items() if k != "per_layer"},
                "per_layer_all_forwards": summary.get("per_layer", {}),
                "prefetch_issued": after["prefetch_issued"] - before["prefetch_issued"],
                "prefetch_used": after["prefetch_used"] - before["prefetch_used"],
                "bytes_read_disk_per_generated_token": (after["bytes_read_disk"] - before["bytes_read_disk"])
                / (len(prompts) * NEW_TOKENS),
                "decode_tokens": decode_tokens,
            }
    return out


# ---- the run ------------------------------------------------------------------------------------------------
def evaluate(model_dir: str | Path, heldout_files: Sequence[Path], *, files: int = FILES, prompts: int = PROMPTS,
             depths: Sequence[int] = DEPTHS, write: bool = True) -> dict[str, Any]:
    from tokenizers import Tokenizer as HFTokenizer

    from tools.train_demo import TrainConfig, stdlib_files

    torch.set_num_threads(2)
    start = time.perf_counter()
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    tok = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
    sample = sample_files(heldout_files, files)
    timings: dict[str, float] = {}

    code = code_prompts(sample, prompts)
    context = max(len(tok.encode(p["prompt"]).ids) for p in code) + NEW_TOKENS + 16
    budget, refused = pick_budget(model_dir, max(context, WINDOW + 8))
    t = time.perf_counter()
    train_cfg = _train_config(model_dir)
    unigram, unigram_tokens = unigram_log_probs(tok, stdlib_files()[0], config["vocab_size"],
                                                train_cfg.get("corpus_bytes", TrainConfig.corpus_bytes))
    with Engine.open(model_dir, budget=Budget(ram=budget), max_context=WINDOW + 8) as engine:
        ppl = perplexity(engine, tok, sample, unigram)
    ppl["unigram_training_tokens"] = unigram_tokens
    ppl["budget"] = budget
    timings["perplexity_s"] = time.perf_counter() - t
    _progress(f"perplexity: model {ppl['model_ppl']:.2f}, unigram {ppl['unigram_ppl']:.1f}", start)

    t = time.perf_counter()
    with Engine.open(model_dir, max_context=1024, spec="mtp") as engine:  # MTP layers as units
        ids = [engine.encode(p["prompt"]) for p in code]
        mtp, plain = mtp_acceptance(engine, ids, depths)
        completions = [engine.tokenizer.decode(out) for out in plain]
        first = code[0]
        generated = engine.generate(first["prompt"], max_new_tokens=48)
    mtp["prompt_tokens_mean"] = sum(map(len, ids)) / len(ids)
    timings["mtp_s"] = time.perf_counter() - t
    _progress("MTP acceptance", start)

    parsed = [parses_as_python(p["header"], c) for p, c in zip(code, completions)]
    sample_out = {"file": first["file"], "prompt_tail": "\n".join(first["prompt"].split("\n")[-6:]).lstrip("\n"),
                  "completion": generated.text, "actual": first["body"][:len(generated.text) + 40],
                  "completions_parsing": sum(1 for k, n in parsed if n and k == n),
                  "completions": len(parsed), "lines_parsing": sum(k for k, _ in parsed),
                  "lines": sum(n for _, n in parsed)}

    t = time.perf_counter()
    prefetch = [prefetch_recall(model_dir, ids[: max(4, len(ids) // 2)], b, context)
                for b in prefetch_budgets(model_dir, budget, context)]
    timings["prefetch_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - start

    result = {"model": str(model_dir), "held_out_files_sampled": [f.name for f in sample],
              "mtp_prompt_files": [p["file"] for p in code],
              "perplexity": ppl, "mtp": mtp, "prefetch": prefetch, "sample": sample_out,
              "budget": {"ram": budget, "refused": refused}, "timings": timings,
              "torch_threads": torch.get_num_threads(), "command": COMMAND,
              "versions": {"python": sys.version.split()[0], "torch": torch.__version__}}
    print(table(result))
    if write:
        (model_dir / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
        (model_dir / "README.md").write_text(model_card(model_dir, config, train_cfg, result))
        print(f"wrote {model_dir / 'eval.json'} and {model_dir / 'README.md'}")
    return result


def _progress(what: str, since: float) -> None:
    print(f"[eval] {what} ({time.perf_counter() - since:.0f} s)", file=sys.stderr, flush=True)


def _train_config(model_dir: Path) -> dict[str, Any]:
    p = model_dir / "train_config.json"
    return json.loads(p.read_text()) if p.is_file() else {}


# ---- reporting ----------------------------------------------------------------------------------------------
def _wrap(text: str) -> str:
    return textwrap.fill(" ".join(text.split()), 110, break_on_hyphens=False)


def figures_markdown(r: dict[str, Any]) -> str:
    """The figures as Markdown tables (the model card's and docs/PERF.md's)."""
    p, m, s = r["perplexity"], r["mtp"], r["sample"]
    lines = [_wrap(f"""Perplexity per token on {p['tokens']:,} held-out tokens ({p['files']} files, up to
                   {WINDOWS_PER_FILE} windows of {p['window']} tokens each; the engine at a {p['budget']} RAM
                   budget), and a unigram model of the training files' tokens (add-one smoothed) on the same
                   tokens:"""), "",
             "| model | perplexity | nats / token |", "| --- | ---: | ---: |",
             f"| demo model | {p['model_ppl']:.2f} | {p['model_nats_per_token']:.3f} |",
             f"| unigram | {p['unigram_ppl']:.1f} | {p['unigram_nats_per_token']:.3f} |", "",
             _wrap(f"""MTP speculative decoding, greedy: {m['prompts']} held-out code prompts (the text up to a
                   function header, {m['prompt_tokens_mean']:.0f} tokens on average), {m['new_tokens']} new
                   tokens each, chains (width 1). Tokens per target forward = 1 + the drafts accepted per
                   verification step; acceptance at depth d = P(draft d accepted | drafts before it
                   accepted):"""), "",
             "| depth | tokens / target forward | acceptance at depth 1, 2, 3 | identical to plain | tok/s |",
             "| ---: | ---: | --- | --- | ---: |",
             f"| plain | 1 | - | - | {m['off']['decode_tok_s']:.0f} |"]
    for d, row in m["depths"].items():
        rates = ", ".join(f"{100 * a:.0f}%" for a in row["acceptance_per_depth"])
        lines.append(f"| {d} | {row['tokens_per_forward']:.2f} | {rates} | "
                     f"{'yes' if row['identical_to_plain'] else 'NO'} | {row['decode_tok_s']:.0f} |")
    lines += ["", _wrap("""tok/s: wall-clock decode speed with every unit resident (2 torch threads, a shared machine:
                        +-20%). On a model this small a forward costs little more than the drafter's own layer
                        and the verification bookkeeping, so fewer forwards need not mean faster decoding; tokens
                        per target forward is the figure that carries over to models whose forwards read
                        experts from disk.""")]
    runs = r["prefetch"]
    lines += ["", _wrap(f"""Expert prefetch, decode steps after the first {runs[0].get('prompts', '?')} code
                        prompts ({NEW_TOKENS} tokens each; prefill excluded), adaptive shut-off disabled so that
                        every step is scored. Recall: routed experts that had been predicted; chance: the recall
                        of as many random guesses; dense: where the dense units (attention, routers) live:"""), "",
              "| RAM budget | dense | predictor | recall | precision | guesses / routed | chance recall |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for pf in runs:
        for which, label in (("lookahead", "router lookahead"), ("prior", "frequency prior"),
                             ("combined", "engine default (both)")):
            if which in pf:
                x = pf[which]
                lines.append(f"| {pf['budget']} | {pf.get('homes', {}).get('dense', '?')} | {label} | "
                             f"{100 * x['recall']:.1f}% | {100 * x['precision']:.1f}% | "
                             f"{x['predicted_per_routed']:.2f} | {100 * x['chance_recall']:.1f}% |")
        if "note" in pf:
            lines += ["", f"{pf['budget']}: {pf['note']}"]
    inert = [pf["budget"] for pf in runs if pf.get("homes", {}).get("dense") == "disk"
             and "lookahead" in pf and pf["lookahead"]["predicted"] == 0]
    if inert:
        lines += ["", _wrap(f"""At {', '.join(inert)} the dense units (attention and routers) stream from disk
                            too, and the router lookahead predicts nothing: it scores only with the layer ahead's
                            dense unit loaded in the compute tier (`store.peek`). The prefetcher asks for dense
                            units one layer beyond the expert horizon, but a budget this small holds two dense
                            slots, one in use and one for the next layer, so the next layer's unit is at best still
                            being read when the prediction is made. The engine's prefetch is then the frequency
                            prior alone.""")]
    if r.get("budget", {}).get("refused"):
        lines += ["", _wrap(f"""Budgets: {r['budget']['ram']} is the smallest of {', '.join(BUDGETS)} this model
                            runs in; smaller ones are below its minimum working set (embedding and head pinned,
                            one streaming slot per unit kind, KV cache, staging): {r['budget']['refused']}.""")]
    lines += ["", _wrap(f"""Greedy completions of the code prompts that parse as Python once cut at their last
                        complete line (an open string or block closed): {s['completions_parsing']} of {s['completions']} in full;
                        {s['lines_parsing']} of {s['lines']} generated lines.""")]
    return "\n".join(lines) + "\n"


def table(r: dict[str, Any]) -> str:
    p, m, s = r["perplexity"], r["mtp"], r["sample"]
    out = [f"perplexity/token  model {p['model_ppl']:.2f}   unigram {p['unigram_ppl']:.1f}   "
           f"({p['tokens']} tokens, {p['files']} files)",
           f"MTP  plain decode {m['off']['decode_tok_s']:.1f} tok/s",
           f"{'depth':>5} {'tok/fwd':>8} {'accepted':>8} {'accept/depth':>20} {'tok/s':>7} identical"]
    for d, row in m["depths"].items():
        rates = " ".join(f"{a:.2f}" for a in row["acceptance_per_depth"])
        out.append(f"{d:>5} {row['tokens_per_forward']:>8.2f} {row['mean_accepted']:>8.2f} {rates:>20} "
                   f"{row['decode_tok_s']:>7.1f} {row['identical_to_plain']}")
    for pf in r["prefetch"]:
        out.append(f"prefetch @ {pf['budget']} (dense on {pf.get('homes', {}).get('dense', '?')}): " + ("; ".join(
            f"{w} recall {pf[w]['recall']:.3f} precision {pf[w]['precision']:.3f} (chance "
            f"{pf[w]['chance_recall']:.3f})" for w in ("lookahead", "prior", "combined") if w in pf)
            or pf.get("note", "")))
    out.append(f"parse as Python: {s['completions_parsing']}/{s['completions']} completions, "
               f"{s['lines_parsing']}/{s['lines']} lines")
    out.append(f"sample ({s['file']}):\n{s['prompt_tail']}\u2502{s['completion']}")
    out.append("time: " + ", ".join(f"{k} {v:.0f}" for k, v in r["timings"].items()))
    return "\n".join(out)


def model_card(model_dir: Path, config: dict, train: dict, r: dict[str, Any]) -> str:
    n_params = _parameter_count(model_dir)
    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    main_loss, mtp_loss = _final_losses(model_dir)
    steps = train.get("steps", "?")
    seen = steps * train.get("batch", 0) * train.get("seq_len", 0) if isinstance(steps, int) else 0
    s = r["sample"]
    L = config["num_hidden_layers"]

    def para(text: str, bullet: bool = False) -> str:
        indent = ("- ", "  ") if bullet else ("", "")
        return textwrap.fill(" ".join(text.split()), 110, break_on_hyphens=False, initial_indent=indent[0],
                             subsequent_indent=indent[1])

    return "\n\n".join([
        "# demo-model",
        para("""A tiny DeepSeek-V3-style mixture-of-experts language model of Python source, bundled with
             `offload_engine` so that examples, tests and benchmarks have a real trained model (real routing
             statistics, a working multi-token-prediction head) on every machine, offline. It writes
             Python-looking code and nothing else: a test fixture, not a useful model."""),
        "## What it is",
        "\n".join([
            para(f"""`DeepseekV3ForCausalLM` in the Hugging Face layout: float32 safetensors, {size / 1e6:.1f} MB,
                 {n_params / 1e6:.2f} M parameters. {L} layers, hidden {config['hidden_size']},
                 {config['num_attention_heads']} heads of multi-head latent attention (q rank
                 {config.get('q_lora_rank')}, kv rank {config.get('kv_lora_rank')}); layer 0 dense, the others
                 MoE: {config['n_routed_experts']} routed experts (top-{config['num_experts_per_tok']}, sigmoid
                 scores, {config.get('n_group')} groups, top-{config.get('topk_group')}) and one shared
                 expert.""", bullet=True),
            para(f"""One multi-token-prediction (MTP) layer, `num_nextn_predict_layers: 1`, under DeepSeek's
                 released names as layer {L}, trained jointly; the engine drafts with it (`spec="mtp"`).""",
                 bullet=True),
            para(f"""A byte-level BPE tokenizer of {config['vocab_size']} tokens; `<|endoftext|>` separates files
                 (ChatML specials exist, but the model never saw a chat).""", bullet=True)]),
        "## How it was trained",
        para(f"""`tools/train_demo.py` on the Python {r['versions']['python']} standard library's own sources
             (test suites, idlelib, lib2to3 and site-packages excluded); every 20th file in sorted order is held
             out. {steps} steps of AdamW (lr {train.get('lr')}, {train.get('warmup')} warmup steps, cosine
             decay), batch {train.get('batch')} x {train.get('seq_len')} tokens ({seen / 1e6:.1f} M tokens seen);
             loss = next-token cross-entropy + {train.get('mtp_weight')} x the MTP loss (token t+2). Routing is
             balanced by DeepSeek-V3's auxiliary-loss-free bias updates (rate {train.get('bias_rate')}). Seed
             {train.get('seed')}: deterministic on one machine. Training loss, mean of the last 100 steps: next
             token {main_loss:.3f} nats, MTP {mtp_loss:.3f} nats (`loss_curve.png`, `loss_curve.json`)."""),
        "## Held-out figures",
        figures_markdown(r).rstrip("\n"),
        para(f"""Sample: greedy `engine.generate(prompt, max_new_tokens=48)` after the text up to a function
             header of the held-out `{s['file']}`; the prompt's last lines, then the completion after
             `\u2502`:"""),
        f"```\n{s['prompt_tail']}\u2502{s['completion']}\n```",
        f"All figures are in `eval.json`. The evaluation took {r['timings']['total_s']:.0f} s with "
        f"{r['torch_threads']} torch threads.",
        "## Reproduce",
        f"```\npython tools/train_demo.py --out offload_engine/data/demo-model --steps {steps}\n{COMMAND}\n```",
    ]) + "\n"


def _parameter_count(model_dir: Path) -> int:
    """Parameters in the files, less the MTP layers' copies of the embedding and head (DeepSeek's format)."""
    from safetensors import safe_open

    n = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                if not re.search(r"\.(embed_tokens|shared_head\.head)\.weight$", k) or k.startswith("model.embed"):
                    n += math.prod(st.get_slice(k).get_shape())
    return n


def _final_losses(model_dir: Path) -> tuple[float, float]:
    p = model_dir / "loss_curve.json"
    if not p.is_file():
        return float("nan"), float("nan")
    tail = json.loads(p.read_text())[-100:]
    return sum(r[1] for r in tail) / len(tail), sum(r[2] for r in tail) / len(tail)


if __name__ == "__main__":
    from tools.train_demo import stdlib_files

    evaluate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "offload_engine" / "data" / "demo-model",
             stdlib_files()[1])
