"""``llmforge export`` and ``generate``: a checkpoint's model written out, or run."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Tuple

from rich.console import Console

from llmforge.errors import Problem, UserError


def export_command(overrides: List[str], *, out_dir: Path, console: Console) -> None:
    """``llmforge export ckpt=PATH --out DIR``: the plan saved with the checkpoint says
    which model and tokenizer to write."""
    from llmforge.checkpoint.export import export_checkpoint, run_tokenizer_file, style_of
    from llmforge.checkpoint.locate import locate
    from llmforge.checkpoint.resume import checkpoint_plan, split_ckpt
    from llmforge.rundir import check_writable

    ckpt, rest = split_ckpt(overrides)
    if rest:
        raise UserError([Problem(o.split("=", 1)[0], o, "export takes no overrides besides ckpt=", "remove it") for o in rest], title="bad overrides")
    for folder in (Path(out_dir), Path(out_dir).parent):  # the files, and the temporary folder beside them
        check_writable(folder, key="--out")
    found = locate(ckpt)
    for note in found.notes:
        console.print(note, style="yellow", markup=False, highlight=False)
    config = checkpoint_plan(found.path).config
    style_of(config.model)  # refuse an unsupported flavour before preparing anything
    try:
        tokenizer: Optional[Tuple[Path, int]] = run_tokenizer_file(config, console=console)
    except UserError as exc:
        tokenizer = None
        console.print(f"the run's tokenizer is not available, so the export has none: {exc.problems[0].render()}", style="yellow", markup=False, highlight=False)
    written = export_checkpoint(found.path, model=config.model, out_dir=out_dir, tokenizer=tokenizer)
    style = "LlamaForCausalLM" if style_of(config.model) == "llama" else "GPT2LMHeadModel"
    console.print(f"exported {found.path} as {style}: " + ", ".join(str(p) for p in written), markup=False, highlight=False)


def generate_command(overrides: List[str], *, prompt: str, device: str, tokenizer: Optional[Path], out: Console, err: Console) -> str:
    """``llmforge generate ckpt=PATH --prompt TEXT [generate.*=...]``; returns the completion."""
    from llmforge.generate import check_settings, checkpoint_config, generate_ids, load_model, pick_device, run_tokenizer

    found, config = checkpoint_config(overrides)
    settings = config.generate
    check_settings(settings)
    tok, eos_id = run_tokenizer(config, tokenizer=tokenizer, console=err)
    where = pick_device(device)
    model = load_model(found, config=config, device=where)
    prompt_ids = tok.encode(prompt).ids
    if not prompt_ids:
        raise UserError([Problem("--prompt", prompt, "encodes to no tokens", "give a non-empty prompt")], title="bad prompt")
    mode = "greedy" if settings.temperature == 0 else f"temperature {settings.temperature:g}, top-k {settings.top_k or 'off'}, top-p {settings.top_p:g}, seed {settings.seed}"
    err.print(f"generating up to {settings.max_tokens} tokens from {found} on {where} ({mode})", highlight=False, markup=False)
    ids = generate_ids(model, prompt_ids, settings=settings, seq_len=config.model.seq_len, eos_id=eos_id, device=where)
    completion = tok.decode(ids)
    out.print(prompt + completion, highlight=False, markup=False, soft_wrap=True)
    return completion
