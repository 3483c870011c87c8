"""Figures a suite counts while it runs (faults injected, interrupts delivered, cases tried) and prints once at
its end, for the closing note: `FIGURES = Figures("io-faults")`, `report_figures = FIGURES.fixture()` at module
level, then `FIGURES.tally(name, n)`."""
from __future__ import annotations

import pytest


def write_line(request, line: str) -> None:
    """A line in pytest's terminal report (shown without -s)."""
    tr = request.config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.write_line(line)


class Figures(dict):
    def __init__(self, label: str):
        super().__init__()
        self.label = label

    def tally(self, name: str, n: int = 1) -> None:
        self[name] = self.get(name, 0) + n

    def fixture(self):
        """A module-scoped autouse fixture that prints the figures after the module's last test."""
        @pytest.fixture(scope="module", autouse=True)
        def report_figures(request):
            yield
            if self:
                write_line(request, f"{self.label}: " + ", ".join(f"{k}={v}" for k, v in sorted(self.items())))

        return report_figures
