"""Text output for the CLI: sizes, durations, tables and a progress bar."""

from __future__ import annotations

import datetime as dt
import sys

from gpushare.settings.settings import parse_duration_s


def human_bytes(n: int) -> str:
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= size:
            return f"{n / size:.1f} {unit}" if n < 10 * size else f"{n / size:.0f} {unit}"
    return f"{n} B"


def human_delta(seconds: float) -> str:
    s = abs(seconds)
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60), ("second", 1)):
        if s >= size:
            n = int(s // size)
            text = f"{n} {unit}{'s' if n != 1 else ''}"
            break
    else:
        text = "less than a second"
    return f"{text} from now" if seconds >= 0 else f"{text} ago"


def parse_time(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    return "\n".join("    ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header] + rows)


def keep_alive_value(text: str | None):
    """A --keep-alive argument as the API takes it: a number of seconds, or a duration string."""
    if text is None:
        return None
    parse_duration_s(text, "--keep-alive")  # fail here, with a clear message
    try:
        return float(text)
    except ValueError:
        return text


def print_model_info(data: dict) -> None:
    """`show`'s summary of an /api/show answer: architecture, sizes, capabilities, parameters, path."""
    info, details = data.get("model_info", {}), data.get("details", {})
    arch = info.get("general.architecture", "")
    lines = [("architecture", arch), ("parameters", details.get("parameter_size", "")),
             ("context length", info.get(f"{arch}.context_length", "")),
             ("embedding length", info.get(f"{arch}.embedding_length", "")),
             ("quantization", details.get("quantization_level", "")), ("format", details.get("format", ""))]
    print("  Model")
    for key, value in lines:
        if value != "":
            print(f"    {key:<20}{value}")
    print("\n  Capabilities")
    for cap in data.get("capabilities", []):
        print(f"    {cap}")
    if data.get("parameters"):
        print("\n  Parameters")
        for line in data["parameters"].splitlines():
            name, _, value = line.partition(" ")
            print(f"    {name:<20}{value.strip()}")
    if data.get("system"):
        print(f"\n  System\n    {data['system'].splitlines()[0]}")
    source = next((ln[5:] for ln in data.get("modelfile", "").splitlines() if ln.startswith("FROM ")), None)
    if source:
        print(f"\n  Path\n    {source}")


class ProgressBar:
    """A one-line bar on a terminal (redrawn with \\r); elsewhere a line per 10% step, for logs."""

    WIDTH = 30

    def __init__(self, label: str, out=None):
        self.label = label
        self.out = out or sys.stderr
        self.tty = self.out.isatty()
        self.shown_step = -1  # the last 10% step written

    def update(self, done: int, total: int) -> None:
        fraction = done / total if total else 0.0
        filled = int(fraction * self.WIDTH)
        text = (f"{self.label} {fraction:4.0%} [{'#' * filled}{' ' * (self.WIDTH - filled)}] "
                f"{human_bytes(done)}/{human_bytes(total)}")
        if self.tty:
            self.out.write("\r" + text)
            self.shown_step = int(fraction * 10)
        elif int(fraction * 10) > self.shown_step:
            self.shown_step = int(fraction * 10)
            self.out.write(text + "\n")
        self.out.flush()

    def close(self) -> None:
        if self.tty and self.shown_step >= 0:
            self.out.write("\n")
            self.out.flush()
