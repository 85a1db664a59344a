"""How the command line shows things: aligned tables, and a checkpoint's summary."""
from __future__ import annotations

from collections.abc import Sequence

from ucp.sizes import human_bytes


def table(rows: Sequence[Sequence[str]], right: Sequence[int] = (), indent: str = "") -> list[str]:
    """`rows` as lines of columns padded to a common width; the columns in `right` align right."""
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return [indent + "  ".join(cell.rjust(w) if c in right else cell.ljust(w)
                               for c, (cell, w) in enumerate(zip(row, widths))).rstrip() for row in rows]


def describe(ckpt, infos) -> str:
    """`ucp inspect`'s summary of an open checkpoint and its tensors (`infos`)."""
    src = ckpt.source
    kind = "ucp checkpoint" if hasattr(ckpt, "index") else "DeepSpeed checkpoint (read through ucp's plan)"
    lines = [f"{kind} {ckpt.path}",
             f"source: {src.get('framework', '?')} {src.get('ds_version', '')} ZeRO-{src.get('zero_stage', '?')} "
             f"dp={src.get('dp', '?')} {src.get('precision', '')}, tag {src.get('tag', '?')}"]
    opt = ckpt.optimizer or {}
    total = sum(i.nbytes for i in infos)
    lines.append(f"step {ckpt.step} · optimizer {opt.get('type', 'none')} ({', '.join(opt.get('states', []))}) · "
                 f"{len(opt.get('param_groups', []))} param groups · {len(infos)} tensors · {human_bytes(total)}")
    if ckpt.extra_files:
        lines.append(f"extra files: {', '.join(ckpt.extra_files)}")
    rows = [("name", "kind", "shape", "pattern", "states", "size")]
    rows += [(i.name, i.kind, "x".join(map(str, i.shape)) or "scalar", i.pattern, " ".join(i.states),
              human_bytes(i.nbytes)) for i in infos]
    lines.append("")
    lines += table(rows)
    lines += [f"alias  {alias} -> {source} (tied: stored once, as {source})" for alias, source in ckpt.aliases.items()]
    if ckpt.not_saved is not None:
        lines += ["", *not_saved_lines(ckpt.not_saved)]
    return "\n".join(lines)


def not_saved_lines(not_saved) -> list[str]:
    """What the checkpoint does not hold, and why (`ucp.format.index.NotSaved`)."""
    lines = [f"not held: every {not_saved.kind} parameter ({not_saved}); a load keeps the model's own values"]
    if not_saved.names:
        lines.append(f"  the checkpoint names {len(not_saved.names)} of them: {', '.join(not_saved.names)}")
    return lines
