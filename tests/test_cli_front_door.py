"""What a new user meets first (issue 46 item 4's front door): --version, a suggestion for a mistyped flag or
subcommand, the prompt from stdin (--prompt -), --context checked against the model's positions, the model as
--model DIR or a positional path alike (the demo model by default), `run --help` with the common flags first,
and every example the --help pages show, run."""
from __future__ import annotations

import io
import json
import shlex
import shutil
import sys
import tomllib
from pathlib import Path

import pytest

from offload_engine.cli import build_parser, main
from offload_engine.frontend.engine_flags import check_context
from offload_engine.defaults import PACKAGE_MODEL
from offload_engine.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def run_json(capsys, *argv: str) -> dict:
    assert main(["run", *argv, "--json", "--quiet"]) == 0
    return json.loads(capsys.readouterr().out)


def test_version_is_the_package_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert capsys.readouterr().out.strip() == f"offload-engine {declared}"


@pytest.mark.parametrize("argv, meant, usage", [
    (["run", "--max-tokens", "5", "--prompt", "x"], "did you mean --max-new-tokens?", "offload-engine run"),
    (["run", "--prompt", "x", "--max_new_tokens", "5"], "did you mean --max-new-tokens?", "offload-engine run"),
    (["run", "--prompt", "x", "--tempature", "0.5"], "did you mean --temperature?", "offload-engine run"),
    (["run", "--prompt", "x", "--spec", "mpt"], "did you mean 'mtp'?", "offload-engine run"),
    (["plan", "--hardwre", "rtx4090-24gb"], "did you mean --hardware?", "offload-engine plan"),
    (["rn", "--prompt", "x"], "did you mean 'run'?", "offload-engine"),
    (["run", "hello", "world", "--prompt", "x"], "the prompt goes in --prompt", "offload-engine run"),
])
def test_a_mistyped_flag_or_command_names_the_one_meant(capsys, argv, meant, usage):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and meant in err and f"usage: {usage}" in err


def test_prompt_from_stdin_is_the_same_prompt(capsys, monkeypatch):
    prompt = "def fibonacci(n):"
    given = run_json(capsys, "--prompt", prompt, "--max-new-tokens", "8")
    monkeypatch.setattr(sys, "stdin", io.StringIO(prompt))
    piped = run_json(capsys, "--prompt", "-", "--max-new-tokens", "8")
    assert piped["token_ids"] == given["token_ids"] and piped["text"] == given["text"]
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main(["run", "--prompt", "-"]) == 2
    assert "stdin is empty" in capsys.readouterr().err


def test_context_beyond_the_model_is_refused_naming_flag_and_limit(capsys, tmp_path):
    assert main(["run", "--prompt", "x", "--context", "100000"]) == 2
    err = capsys.readouterr().err
    assert "--context 100000" in err and "at most 2048 positions" in err
    check_context(PACKAGE_MODEL, 2048)  # the limit itself is fine
    # a rope scaling stretches the limit: YaRN x8 over 256 original positions
    config = json.loads((PACKAGE_MODEL / "config.json").read_text())
    config.update(max_position_embeddings=512, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 256})
    (tmp_path / "config.json").write_text(json.dumps(config))
    check_context(tmp_path, 2048)
    with pytest.raises(ConfigError, match=r"at most 2048 positions \(with its rope scaling\)"):
        check_context(tmp_path, 2049)


def test_the_model_as_flag_or_positional_path(capsys, tmp_path):
    model = str(PACKAGE_MODEL)
    assert main(["inspect", model, "--json"]) == 0
    positional = json.loads(capsys.readouterr().out)
    assert main(["inspect", "--model", model, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == positional
    assert main(["inspect", "--json"]) == 0  # the demo model by default
    assert json.loads(capsys.readouterr().out) == positional
    flag = run_json(capsys, "--model", model, "--prompt", "Hello", "--max-new-tokens", "4")
    assert run_json(capsys, model, "--prompt", "Hello", "--max-new-tokens", "4")["token_ids"] == flag["token_ids"]
    assert main(["inspect", model, "--model", str(tmp_path)]) == 2
    assert "the model is given twice" in capsys.readouterr().err
    parser = build_parser()
    from offload_engine.frontend.common import choose_model

    for argv in (["quantize", model, "--out", "x", "--weights", "int8"], ["serve", model], ["plan", model]):
        args = parser.parse_args(argv)
        choose_model(args)
        assert args.model == model, argv


def test_run_help_shows_common_flags_first():
    text = build_parser()._subparsers._group_actions[0].choices["run"].format_help()
    options = text.index("\noptions:")
    for flag in ("--prompt TEXT", "--max-new-tokens N", "--temperature", "--ram SIZE", "--context N"):
        assert options < text.index(f"  {flag}") < text.index("(expert):"), flag
    for heading, flag in (("memory, I/O and kernels (expert):", "--policy"), ("expert prefetch (expert):", "--prefetch "),
                          ("speculative decoding (expert):", "--spec-depth"), ("structured output:", "--grammar")):
        assert text.index(heading) < text.index(f"  {flag}"), flag
    assert text.startswith("usage: offload-engine run [MODEL | --model DIR] --prompt TEXT [options]")


# ---- every example of every --help page -------------------------------------------------------------------------
def help_examples() -> list[tuple[str, list[str], str | None]]:
    """(subcommand, argv, stdin) of each `offload-engine ...` line in the subcommands' epilogs."""
    out = []
    for name, sub in build_parser()._subparsers._group_actions[0].choices.items():
        for line in (sub.epilog or "").splitlines():
            if "offload-engine " not in line:
                continue
            stdin = None
            if "|" in line and "offload-engine" in line.split("|", 1)[1]:
                feed, line = line.split("|", 1)
                stdin = shlex.split(feed)[1] if feed.strip().startswith("echo") else None
            words = shlex.split(line, comments=True)
            if words[:1] == ["offload-engine"]:
                out.append((name, words[1:], stdin))
    return out


EXAMPLES = help_examples()


def local(argv: list[str], tmp: Path, plan_folder: Path) -> list[str]:
    """The example with its placeholder paths made real: a model (DIR, ~/models/NAME) is the demo model (which
    has MTP layers, and is its own draft model: the same tokenizer); `plan`'s model folder is a copy of its
    config.json (a --probe reads a scratch file in the model's folder); output paths go to tmp. The probe's
    --size is cut to 16 MiB (it reads that much back from disk: the examples' sizes measure, not check)."""
    out, previous = [], None
    for word in argv:
        if previous in ("--out", "--dir"):
            word = str(tmp / f"out{len(out)}") if previous == "--out" else str(tmp)
        elif previous == "--size":
            word = "16MiB"
        elif previous == "--calibrate":
            word = str(tmp / "sample.txt")
        elif word == "DIR" or word.startswith("~/models/"):
            word = str(plan_folder if argv[0] == "plan" else PACKAGE_MODEL)
        out.append(word)
        previous = word if word.startswith("--") else None
    return out


def test_every_help_page_has_examples():
    assert {name for name, _, _ in EXAMPLES} == {"run", "inspect", "serve", "plan", "probe", "quantize"}


@pytest.mark.parametrize("name, argv, stdin", EXAMPLES, ids=[" ".join(a)[:60] for _, a, _ in EXAMPLES])
def test_help_example_runs(name, argv, stdin, tmp_path, monkeypatch, capsys):
    plan_folder = tmp_path / "plan-model"
    plan_folder.mkdir()
    shutil.copy(PACKAGE_MODEL / "config.json", plan_folder / "config.json")
    (tmp_path / "sample.txt").write_text(Path(json.__file__).read_text(encoding="utf-8")[:6000], encoding="utf-8")
    argv = local(argv, tmp_path, plan_folder)
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    if name == "serve":  # serving blocks until Ctrl-C: its flags are parsed and checked as `serve` checks them
        from offload_engine.frontend.common import choose_model
        from offload_engine.frontend.serve import check_serve_flags

        args = build_parser().parse_args(argv)
        choose_model(args)
        check_serve_flags(args)
        return
    if name == "probe":  # quick, and its scratch file small and in tmp (not the current folder)
        argv += ["--quick"] + [x for flag, value in (("--dir", str(tmp_path)), ("--size", "16MiB"))
                               if flag not in argv for x in (flag, value)]
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0, f"{' '.join(argv)}\n{captured.err[-2000:]}"
