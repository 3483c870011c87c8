"""The budget ledger: every byte allocated for weights, staging and KV cache is charged here *before* it is
allocated, so exceeding a budget is impossible by construction (RELIABILITY rule 5)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ..errors import BudgetError


@dataclass
class TierAccount:
    budget: int | None
    charged: int = 0
    peak: int = 0
    items: dict[str, int] = field(default_factory=dict)


class Ledger:
    def __init__(self, budgets: dict[str, int | None]):
        self.accounts = {name: TierAccount(b) for name, b in budgets.items()}
        self._lock = threading.Lock()

    def charge(self, tier: str, nbytes: int, what: str) -> None:
        with self._lock:
            acct = self.accounts[tier]
            if acct.budget is not None and acct.charged + nbytes > acct.budget:
                raise BudgetError(tier, acct.charged + nbytes, acct.budget, {**acct.items, what: nbytes})
            acct.charged += nbytes
            acct.items[what] = acct.items.get(what, 0) + nbytes
            acct.peak = max(acct.peak, acct.charged)

    def credit(self, tier: str, nbytes: int, what: str) -> None:
        with self._lock:
            acct = self.accounts[tier]
            acct.charged -= nbytes
            acct.items[what] = acct.items.get(what, 0) - nbytes
            if not acct.items[what]:
                del acct.items[what]

    def peak(self) -> dict[str, int]:
        return {name: a.peak for name, a in self.accounts.items()}

    def charged(self) -> dict[str, int]:
        return {name: a.charged for name, a in self.accounts.items()}

    def budgets(self) -> dict[str, int | None]:
        return {name: a.budget for name, a in self.accounts.items()}
