"""What a DeepSpeed or Accelerate config file resolved to, said at start and kept as the metrics file's
first record: every setting the file gave, or left to others with ``"auto"`` (then the command line's, another
file's or megazero's default), or took from DeepSpeed's default (an absent scheduler key), with its final value::

    entries = resolved(values, decided, job, elsewhere)   # {"lr": {"value": 3e-4, "auto": "from --lr"}, ...}
    resolved_line("--deepspeed-config ds.json", entries)
    # --deepspeed-config ds.json resolved: lr=0.0003 (auto: from --lr), ..., lr_warmup_style=log (absent: ...)
"""
from __future__ import annotations

from megazero.foreign_config.reader import AUTO, DEFAULT

# How the warm-up shapes the learning rate, named at start (DeepSpeed's default surprises users of linear ones).
WARMUP_SHAPES = {"log": "DeepSpeed's log warm-up: the LR rises as log(step + 1) / log(warm-up steps) of the peak, "
                        "steep at first",
                 "linear": "a linear warm-up from 0 to the peak"}


def resolved(values: dict, decided: dict, job, elsewhere: dict) -> dict[str, dict]:
    """{field: {"value": final value, and "auto": where it came from, or "default": whose}} of every setting
    a file's ``values`` give or its ``decided`` ({dest: AUTO or DEFAULT}) leave to others, in the file's
    order. ``job``: the validated job (the final values); ``elsewhere``: {dest: what gave an ``"auto"``
    setting instead (a flag's spelling, another file)}."""
    out = {}
    for dest in [*values, *(d for d in decided if d not in values)]:
        section, name = dest.split(".")
        entry = {"value": getattr(getattr(job, section), name)}
        if decided.get(dest) == AUTO:
            entry["auto"] = f"from {elsewhere[dest]}" if dest in elsewhere else "megazero's default"
        elif decided.get(dest) == DEFAULT:
            entry["default"] = "DeepSpeed's default"
        out[name] = entry
    return out


def resolved_line(source: str, entries: dict[str, dict]) -> str:
    """One line listing ``entries`` (:func:`resolved`), the warm-up's shape named."""
    parts = []
    for name, entry in entries.items():
        how = [f"auto: {entry['auto']}"] if "auto" in entry else [f"absent: {entry['default']}"] if "default" in entry \
            else []
        if name == "lr_warmup_style" and entry["value"] in WARMUP_SHAPES:
            how.append(WARMUP_SHAPES[entry["value"]])
        parts.append(f"{name}={entry['value']}" + (f" ({'; '.join(how)})" if how else ""))
    return f" {source} resolved: {', '.join(parts)}"
