"""The plain-text tables of one run and of several side by side (pure: figures in, text out).

The figures and their exact definitions are :mod:`llm_backoff_shim.lab.figures`.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from llm_backoff_shim.lab.figures import FAST_FAILURE, Figures
from llm_backoff_shim.lab.scenario import Scenario


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 0.1:
        return f"{value * 1000:.1f} ms"
    return f"{value:.2f} s"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def rows(f: Figures) -> list[tuple[str, str]]:
    """The table of one configuration: (figure, value) pairs in display order."""
    failed = f.calls - f.ok
    fail_note = (
        f"{f.failed_fast} fast typed errors (median {_seconds(f.median_time_to_fail_fast)}), "
        f"{f.failed_deadline} ran into the deadline ({f.deadline_while_served} of them mid-stream)"
        if failed
        else "none"
    )
    ceiling = (
        ""
        if f.useful_fraction is None
        else f" = {f.useful_fraction:.0%} of the ceiling {f.useful_ceiling:.0f}"
    )
    return [
        (
            "success within deadline",
            f"{f.ok}/{f.calls} = {f.success_rate:.0%}"
            + (
                f" ({f.interactive_late} of them interactive answers begun after the {f.ttft_budget:g} s "
                "TTFT budget)"
                if f.interactive_calls
                else ""
            ),
        ),
        ("useful tokens", f"{f.useful_tokens}{ceiling} (answers served within their class's budget)"),
        (
            "interactive served within budget",
            f"{f.interactive_within_budget}/{f.interactive_calls} (TTFT <= {f.ttft_budget:g} s)",
        ),
        (
            "batch served",
            f"{f.batch_ok}/{f.batch_calls}" + (f" = {_share(f.batch_served)}" if f.batch_calls else ""),
        ),
        ("failures", fail_note),
        (
            "  known within 1 s / p90 time to failure",
            f"{_share(f.failed_fast_share)} / {_seconds(f.failure_p90)}",
        ),
        (
            "interactive TTFT p50 / p99",
            f"{_seconds(f.ttft_p50)} / {_seconds(f.ttft_p99)} (budget {f.ttft_budget:g} s, "
            f"{f.ok_interactive}/{f.interactive_calls} interactive ok)",
        ),
        (
            "time to rejection p50 / p99",
            f"{_seconds(f.rejection_p50)} / {_seconds(f.rejection_p99)} ({f.rejections} rejections"
            + (f"; queue_full only: p99 {_seconds(f.queue_full_p99)}" if f.queue_full_p99 is not None else "")
            + ")",
        ),
        *(
            [
                (
                    "  same, inside the shim",
                    f"{_seconds(f.shim_rejection_p50)} / {_seconds(f.shim_rejection_p99)} "
                    f"({f.shim_rejections_matched} of {f.rejections} matched in its access log"
                    + (
                        "; p99 after the request's body was read: "
                        + _seconds(f.shim_rejection_after_body_p99)
                        if f.shim_rejection_after_body_p99 is not None
                        else ""
                    )
                    + (
                        f"; {f.shim_refused_from_head} answered from its head"
                        if f.shim_refused_from_head
                        else ""
                    )
                    + ")",
                )
            ]
            if f.shim_rejections_matched
            else []
        ),
        *(
            [
                (
                    "  same, on the wire",
                    f"p99 {_seconds(f.wire_rejection_p99)} (request's last byte to the answer's first, "
                    f"kernel timestamps; {f.wire_rejections} of {f.rejections} matched)",
                )
            ]
            if f.wire_rejection_p99 is not None
            else []
        ),
        *(
            [
                (
                    "  p99 from the request's head / writing it",
                    f"{_seconds(f.rejection_from_head_p99)} / {_seconds(f.rejection_write_p99)} "
                    "(the figure above is from its last byte; between head and last byte: the "
                    "load generator's own lag)",
                )
            ]
            if f.rejection_write_p99 is not None
            else []
        ),
        (
            "rejections by code",
            ", ".join(f"{k} x{v}" for k, v in f.rejections_by_code.items()) or "none",
        ),
        *(
            [("  decided (shim's log)", ", ".join(f"{k} x{v}" for k, v in f.shim_rejections_by_when.items()))]
            if f.shim_rejections_by_when is not None
            else []
        ),
        (
            "HTTP attempts per success",
            "-"
            if f.attempts_per_success is None
            else f"{f.attempts_per_success:.2f} ({f.attempts} attempts)",
        ),
        (
            "goodput",
            f"{f.goodput:.2f}/s = {f.goodput_fraction:.1%} of capacity {f.capacity:.2f}/s "
            f"(over the {f.run_span:.1f} s run)",
        ),
        (
            "engine work wasted",
            f"{f.wasted_tokens}/{f.tokens_generated} tokens = {f.wasted_fraction:.0%} (callers already gone)",
        ),
        ("largest retry wave", f"{f.retry_wave} retries in 100 ms ({f.retries} retries)"),
        (
            "admitted on first retry",
            f"{_share(f.first_retry_admitted)} of {f.first_retries} rejected-then-retried calls",
        ),
        (
            "peak queue (engine / proxy)",
            f"{'-' if f.engine_peak_waiting is None else f.engine_peak_waiting} / "
            f"{'-' if f.proxy_peak_queued is None else f.proxy_peak_queued}",
        ),
        ("calls failed with", ", ".join(f"{k} x{v}" for k, v in f.errors.items()) or "none"),
    ]


def table(f: Figures) -> str:
    pairs = rows(f)
    width = max(len(k) for k, _ in pairs)
    lines = [f"== {f.label} =="]
    lines += [f"  {k:<{width}}  {v}" for k, v in pairs]
    return "\n".join(lines)


def _seconds_row(label: str, values: Sequence[float | None]) -> list[list[str]]:
    """A comparison row of times, or none when no configuration measured it."""
    if all(v is None for v in values):
        return []
    return [[label, *[_seconds(v) for v in values]]]


def comparison(all_figures: Sequence[Figures]) -> str:
    """One compact side-by-side table of the headline figures."""
    header = ["", *[f.label for f in all_figures]]
    lines_data: list[list[str]] = [
        ["useful tokens", *[str(f.useful_tokens) for f in all_figures]],
        *(
            [["  of the ceiling", *[_share(f.useful_fraction) for f in all_figures]]]
            if any(f.useful_fraction is not None for f in all_figures)
            else []
        ),
        [
            "interactive within budget",
            *[f"{f.interactive_within_budget}/{f.interactive_calls}" for f in all_figures],
        ],
        ["batch served", *[_share(f.batch_served) for f in all_figures]],
        ["failures known < 1 s", *[_share(f.failed_fast_share) for f in all_figures]],
        *_seconds_row("p90 time to failure", [f.failure_p90 for f in all_figures]),
        ["success within deadline", *[f"{f.success_rate:.0%}" for f in all_figures]],
        ["interactive TTFT p99", *[_seconds(f.ttft_p99) for f in all_figures]],
        ["p99 time to rejection", *[_seconds(f.rejection_p99) for f in all_figures]],
        *(
            [["  same, inside the shim", *[_seconds(f.shim_rejection_p99) for f in all_figures]]]
            if any(f.shim_rejections_matched for f in all_figures)
            else []
        ),
        *_seconds_row("  from the request's head", [f.rejection_from_head_p99 for f in all_figures]),
        *_seconds_row("  on the wire", [f.wire_rejection_p99 for f in all_figures]),
        *_seconds_row(
            "  inside the shim, after the body", [f.shim_rejection_after_body_p99 for f in all_figures]
        ),
        [
            "attempts per success",
            *[
                "-" if f.attempts_per_success is None else f"{f.attempts_per_success:.2f}"
                for f in all_figures
            ],
        ],
        ["goodput / capacity", *[f"{f.goodput_fraction:.1%}" for f in all_figures]],
        ["wasted engine work", *[f"{f.wasted_fraction:.0%}" for f in all_figures]],
        ["largest retry wave /100ms", *[str(f.retry_wave) for f in all_figures]],
        ["failed fast / at deadline", *[f"{f.failed_fast} / {f.failed_deadline}" for f in all_figures]],
    ]
    table_rows = [header, *lines_data]
    widths = [max(len(r[i]) for r in table_rows) for i in range(len(header))]
    out = []
    for n, r in enumerate(table_rows):
        out.append(
            "  ".join(cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(r))
        )
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def _render(header: Sequence[str], table_rows: Sequence[tuple[list[str], str]], width: int) -> str:
    """Columns aligned as :func:`comparison`'s, each row followed by its explanation, indented
    and wrapped at ``width``."""
    cells = [list(header), *[r for r, _ in table_rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(r: Sequence[str]) -> str:
        padded = (c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r))
        return "  ".join(padded).rstrip()

    out = [line(header), "  ".join("-" * w for w in widths)]
    for r, note in table_rows:
        out.append(line(r))
        out += textwrap.wrap(note, width=width, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(out)


def explained_comparison(all_figures: Sequence[Figures], scenario: Scenario, width: int = 100) -> str:
    """The demo's summary: :func:`comparison`'s headline figures side by side, each row followed
    by one line saying what it counts, with this run's deadlines and budgets in it, so that no
    figure needs the docs to be read (docs/demo.md, 'Reading the table', has the same rules)."""
    fs = list(all_figures)
    budget = f"{scenario.ttft_budget:g} s"
    i_deadline, b_deadline = scenario.deadline_of("interactive"), scenario.deadline_of("batch")
    ceiling = next((f.useful_ceiling for f in fs if f.useful_ceiling), None)
    token_rate = None if ceiling is None else ceiling / (scenario.duration + b_deadline)
    capacity = fs[0].capacity if fs else 0.0
    rows: list[tuple[list[str], str]] = [
        (
            ["useful tokens", *[str(f.useful_tokens) for f in fs]],
            "answer tokens of the calls served within their budget (the next two rows): what the "
            "callers could use",
        ),
    ]
    if ceiling is not None and token_rate is not None:
        rows.append(
            (
                ["  of the ceiling", *[_share(f.useful_fraction) for f in fs]],
                f"of {ceiling:.0f} tokens: the engine's {token_rate:.0f} answer tokens/s over the "
                f"{scenario.duration:g} s of arrivals plus the {b_deadline:g} s batch deadline, the most "
                "any scheduler could deliver",
            )
        )
    rows += [
        (
            [
                "interactive within budget",
                *[f"{f.interactive_within_budget}/{f.interactive_calls}" for f in fs],
            ],
            f"interactive calls done within {i_deadline:g} s whose first token came within {budget}",
        ),
        (
            ["batch served", *[_share(f.batch_served) for f in fs]],
            f"batch calls done within their {b_deadline:g} s deadline",
        ),
        (
            ["success within deadline", *[f"{f.success_rate:.0%}" for f in fs]],
            "calls done by their deadline, however late their first token: it counts the late "
            "interactive answers of the next row as successes",
        ),
        (
            ["  interactive served late", *[str(f.interactive_late) for f in fs]],
            f"interactive answers that began after the {budget} budget (a user saw nothing for "
            "longer); llm_backoff's callers state that budget and get a refusal instead",
        ),
        (
            ["interactive TTFT p99", *[_seconds(f.ttft_p99) for f in fs]],
            f"from starting the call (waits and retries included) to its first token, over the "
            f"successful interactive calls; budget {budget}",
        ),
        (
            ["failed fast / at deadline", *[f"{f.failed_fast} / {f.failed_deadline}" for f in fs]],
            "failed calls ended early by a typed error (a refusal the client would not wait out) / "
            "calls cut by their caller's deadline",
        ),
        (
            ["failures known < 1 s", *[_share(f.failed_fast_share) for f in fs]],
            f"share of the failed calls whose caller knew within {FAST_FAILURE:g} s of starting",
        ),
        *[
            (r, "from starting the call to its failure, over the failed calls")
            for r in _seconds_row("p90 time to failure", [f.failure_p90 for f in fs])
        ],
        (
            ["p99 time to rejection", *[_seconds(f.rejection_p99) for f in fs]],
            "from an HTTP attempt's last byte to its 429/503; the long ones waited in the shim's "
            "queue first and left it unserved (queue_timeout)"
            + ("; - where no attempt was refused" if any(f.rejection_p99 is None for f in fs) else ""),
        ),
        (
            [
                "attempts per success",
                *["-" if f.attempts_per_success is None else f"{f.attempts_per_success:.2f}" for f in fs],
            ],
            "HTTP attempts sent, retries included, per successful call",
        ),
        (
            ["goodput / capacity", *[f"{f.goodput_fraction:.1%}" for f in fs]],
            f"successful calls per second over the whole run, over the engine's {capacity:.2f}/s; "
            "late interactive answers count as successful here too",
        ),
        (
            ["wasted engine work", *[f"{f.wasted_fraction:.0%}" for f in fs]],
            "tokens the engine generated for callers who had already hung up (streams cut at their "
            "deadline), over all it generated",
        ),
        (
            ["largest retry wave /100ms", *[str(f.retry_wave) for f in fs]],
            "the most retries sent within any 100 ms",
        ),
    ]
    return _render(["", *[f.label for f in fs]], rows, width)


def _times(part: int, whole: int) -> str:
    return "-" if whole == 0 else f"{part / whole:.2f}x"


def reading(all_figures: Sequence[Figures], batch_wait: float | None) -> str:
    """What the summary says about the shim for plain clients, from its own figures: the first
    configuration is straight at the engine, the second plain openai through the shim, the
    third llm_backoff through the shim (the demo's order)."""
    if len(all_figures) < 3:
        return ""
    direct, plain, backoff = all_figures[0], all_figures[1], all_figures[2]
    held = "refuses past its wait" if batch_wait is None else f"holds batch callers up to {batch_wait:g} s"
    return (
        "Reading it: through the shim, plain openai gets "
        f"{plain.interactive_within_budget} interactive calls within budget against "
        f"{direct.interactive_within_budget} straight at the engine, and {_share(plain.batch_served)} "
        f"of batch against {_share(direct.batch_served)}: useful tokens "
        f"{_times(plain.useful_tokens, direct.useful_tokens)} of those straight at the engine. The shim "
        "serves interactive first and "
        f"{held}; at twice capacity some calls cannot be served by anyone, and plain openai sends no "
        "deadline, so the shim cannot tell which waiting calls can still finish in time "
        f"({plain.wasted_fraction:.0%} of the engine's work went to callers already gone). "
        "llm_backoff sends its deadline and gives up early on a refusal it cannot wait out: useful "
        f"tokens {_times(backoff.useful_tokens, direct.useful_tokens)} of plain openai straight at "
        f"the engine, {backoff.wasted_fraction:.0%} wasted. Success within deadline counts an "
        f"interactive answer that began after its {backoff.ttft_budget:g} s budget as a success: "
        f"{direct.interactive_late}, {plain.interactive_late} and {backoff.interactive_late} of "
        "them here. llm_backoff's interactive callers state that budget, so where the others get "
        "a late answer they get a refusal"
        + (
            ""
            if backoff.median_time_to_fail_fast is None
            else f" (median {_seconds(backoff.median_time_to_fail_fast)} after starting)"
        )
        + f", and its success rate ({backoff.success_rate:.0%}, against {direct.success_rate:.0%} "
        f"and {plain.success_rate:.0%}) is not the figure to compare: useful tokens are."
    )
