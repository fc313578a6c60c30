"""``llmforge export`` and ``generate``: a checkpoint's model written out, or run."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from rich.console import Console

from llmforge.checkpoint.export_folder import refuse_other_files
from llmforge.config.choices import Qat
from llmforge.errors import Problem, UserError
from llmforge.files import disk_full
from llmforge.rundir import check_writable, refuse_run_outputs
from llmforge.storage import local_output


def export_command(
    overrides: list[str], *, out_dir: str | Path, console: Console, quantize: str = "auto", group_size: int | None = None
) -> None:
    """``llmforge export ckpt=PATH --out DIR [--quantize SCHEME] [--group-size N]``: the plan saved
    with the checkpoint says which model and tokenizer to write, and (``auto``) how a QAT run is quantized."""
    from llmforge.checkpoint.export import check_exportable, export_checkpoint, run_tokenizer_file, style_of
    from llmforge.checkpoint.locate import locate
    from llmforge.checkpoint.resume import checkpoint_plan, split_ckpt

    ckpt, rest = split_ckpt(overrides)
    if rest:
        raise UserError(
            [Problem(o.split("=", 1)[0], o, "export takes no overrides besides ckpt=", "remove it") for o in rest], title="bad overrides"
        )
    out_dir = local_output(out_dir, key="--out", example="exported/NAME")
    for folder in (out_dir, out_dir.parent):  # the files, and the temporary folder beside them
        check_writable(folder, key="--out")
    refuse_run_outputs(out_dir, key="--out", example="export")
    refuse_other_files(out_dir, key="--out")
    found = locate(ckpt)
    for note in found.notes:
        console.print(note, style="yellow", markup=False, highlight=False)
    config = checkpoint_plan(found.path).config
    style_of(config.model)  # refuse an unsupported flavour before preparing anything
    check_exportable(config.model)
    quantization = export_quantization(config, quantize=quantize, group_size=group_size)
    try:
        tokenizer: tuple[Path, int] | None = run_tokenizer_file(config, console=console)
    except UserError as exc:
        tokenizer = None
        console.print(
            f"the run's tokenizer is not available, so the export has none: {exc.problems[0].render()}",
            style="yellow",
            markup=False,
            highlight=False,
        )
    try:
        written = export_checkpoint(found.path, model=config.model, out_dir=out_dir, tokenizer=tokenizer, quantize=quantization)
    except Exception as exc:
        if not disk_full(exc):
            raise
        raise _no_space(Path(out_dir), exc) from None
    style = (
        "GPT2LMHeadModel"
        if style_of(config.model) == "gpt2"
        else ("MinistralForCausalLM" if config.model.sliding_window > 0 else "LlamaForCausalLM")
    )
    if quantization:
        style += (
            f" and quantized {quantization[0]} (group size {quantization[1]}; llmforge.checkpoint.quantized.load_quantized, docs/qat.md)"
        )
    console.print(f"exported {found.path} as {style}: " + ", ".join(str(p) for p in written), markup=False, highlight=False)


def _no_space(out_dir: Path, exc: BaseException) -> UserError:
    """A write of the export failed on a full disk, a quota or the file-size limit (``ulimit -f``)."""
    from llmforge.checkpoint.failures import save_failure

    why, fix = save_failure(exc, root=out_dir.parent)
    return UserError([Problem("--out", str(out_dir), f"the export could not be written: {why}", fix)], title="no space for the export")


def export_quantization(config, *, quantize: str, group_size: int | None) -> tuple[str, int] | None:
    """(scheme, group size) to quantize the export with, or None. ``auto``: the run's
    precision.qat (None for a run without QAT); a scheme name quantizes any run (post-training)."""
    from llmforge.config.qat_rules import QAT_SCHEMES, fitting_group_size
    from llmforge.plan import installed

    pr = config.precision
    scheme = pr.qat if quantize == "auto" else quantize
    if scheme not in QAT_SCHEMES:
        raise UserError(
            [Problem("--quantize", quantize, "not a quantization scheme", f"use one of: auto, {', '.join(QAT_SCHEMES)}")],
            title="bad option",
        )
    size = group_size if group_size is not None else (pr.qat_group_size if pr.qat != Qat.NONE else 32)
    widths = (config.model.hidden_size, config.model.ffn_hidden_size)
    if scheme != Qat.NONE and (size < 1 or all(w % size for w in widths)):
        raise UserError(
            [
                Problem(
                    "--group-size",
                    size,
                    f"divides no linear layer's input width (model.hidden_size={widths[0]}, model.ffn_hidden_size={widths[1]})",
                    f"use --group-size {fitting_group_size(size, widths=widths)}",
                )
            ],
            title="bad option",
        )
    if scheme != Qat.NONE and pr.qat not in (Qat.NONE, scheme):
        raise UserError(
            [
                Problem(
                    "--quantize",
                    quantize,
                    f"the run trained with precision.qat={pr.qat}, and the export would quantize another way",
                    f"use --quantize {pr.qat} (or auto)",
                )
            ],
            title="bad option",
        )
    if scheme != Qat.NONE and not installed("torchao"):
        key, value = ("precision.qat", pr.qat) if quantize == "auto" else ("--quantize", quantize)
        raise UserError(
            [
                Problem(
                    key,
                    value,
                    "the export quantizes the model with torchao, which is not installed",
                    "pip install 'llmforge[fp8]' (or pip install torchao), or pass --quantize none for the Hugging Face folder alone",
                )
            ],
            title="cannot quantize the export",
        )
    return None if scheme == Qat.NONE else (scheme, size)


def generate_command(
    overrides: list[str],
    *,
    prompt: str | None,
    prompts: Path | None,
    out_file: str | Path | None,
    device: str,
    tokenizer: Path | None,
    out: Console,
    err: Console,
) -> list[str]:
    """``llmforge generate ckpt=PATH --prompt TEXT | --prompts FILE [--out FILE] [generate.*=...]``;
    returns the completions. Texts go to stdout, or with ``--out`` one JSON object a line to FILE."""
    from llmforge.generate import check_settings, checkpoint_config, generate_ids, load_model, pick_device, run_tokenizer

    texts = _prompts(prompt=prompt, prompts=prompts)
    if out_file is not None:
        out_file = local_output(out_file, key="--out", example="completions.jsonl")
        _check_out_file(out_file, inputs={"--prompts": prompts, "--tokenizer": tokenizer})
    found, config = checkpoint_config(overrides)
    settings = config.generate
    check_settings(settings)
    tok, eos_id = run_tokenizer(config, tokenizer=tokenizer, console=err)
    encoded = [tok.encode(text).ids for text in texts]
    empty = [i for i, ids in enumerate(encoded) if not ids]
    if empty:
        key = "--prompt" if prompts is None else f"--prompts line {empty[0] + 1}"
        raise UserError([Problem(key, texts[empty[0]], "encodes to no tokens", "give a non-empty prompt")], title="bad prompt")
    for i, ids in enumerate(encoded):
        if len(ids) > config.model.seq_len:
            which = "--prompt" if prompts is None else f"--prompts line {i + 1}"
            err.print(
                f"{which} is {len(ids)} tokens, longer than the model's {config.model.seq_len} positions (model.seq_len): "
                f"it continues from the last {config.model.seq_len} tokens",
                style="yellow",
                highlight=False,
                markup=False,
            )
    where = pick_device(device)
    model = load_model(found, config=config, device=where)
    mode = (
        "greedy"
        if settings.temperature == 0
        else f"temperature {settings.temperature:g}, top-k {settings.top_k or 'off'}, top-p {settings.top_p:g}, seed {settings.seed}"
    )
    cache = "KV cache" if settings.kv_cache else "no KV cache"
    err.print(
        f"generating up to {settings.max_tokens} tokens for {len(texts)} prompt(s) from {found} on {where} ({mode}, {cache})",
        highlight=False,
        markup=False,
    )
    start, completions, generated = time.perf_counter(), [], 0
    for text, ids in zip(texts, encoded, strict=False):
        new = generate_ids(model, ids, settings=settings, seq_len=config.model.seq_len, eos_id=eos_id, device=where)
        generated += len(new)
        completions.append(tok.decode(new))
        if out_file is None:
            out.print(text + completions[-1], highlight=False, markup=False, soft_wrap=True)
    seconds = time.perf_counter() - start
    if out_file is not None:
        _write_jsonl(out_file, [{"prompt": t, "completion": c} for t, c in zip(texts, completions, strict=False)])
    err.print(f"{generated} tokens in {seconds:.2f} s: {generated / max(seconds, 1e-9):,.1f} tokens/s", highlight=False, markup=False)
    return completions


def _check_out_file(out_file: Path, *, inputs: dict[str, Path | None]) -> None:
    """Before any work: ``--out`` is a file that can be written, none of the inputs, and none of a run's files."""
    path = Path(out_file).expanduser()
    if path.is_dir():
        raise UserError(
            [Problem("--out", str(out_file), "is a folder", "name a file, e.g. --out completions.jsonl")], title="cannot write the output"
        )
    check_writable(path.parent, key="--out", given=Path(out_file))
    for key, given in inputs.items():
        if given is not None and _same_file(Path(given).expanduser(), path):
            raise UserError(
                [Problem("--out", str(out_file), f"is the {key} file this command reads", "write the output to another file")],
                title="cannot write the output",
            )
    refuse_run_outputs(path, key="--out", example="completions.jsonl")


def _same_file(a: Path, b: Path) -> bool:
    """The same file, through links and hard links too."""
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return os.path.realpath(a) == os.path.realpath(b)


def _prompts(*, prompt: str | None, prompts: Path | None) -> list[str]:
    """The prompts to continue: ``--prompt`` or the lines of ``--prompts`` (exactly one of them)."""
    if (prompt is None) == (prompts is None):
        raise UserError(
            [Problem("--prompt", prompt, "give exactly one of --prompt TEXT and --prompts FILE", "pass one of them")], title="bad prompt"
        )
    if prompts is None:
        return [prompt]  # type: ignore[list-item]
    try:
        lines = [line for line in Path(prompts).read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(
            [Problem("--prompts", str(prompts), f"cannot be read: {exc}", "give a UTF-8 text file with one prompt a line")],
            title="bad prompts",
        ) from None
    if not lines:
        raise UserError([Problem("--prompts", str(prompts), "has no prompts", "write one prompt a line")], title="bad prompts")
    return lines


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    """All rows or nothing: written beside the target, then moved over it."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(path).with_name(f".{Path(path).name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, path)
