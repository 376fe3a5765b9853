"""What the SDK scripts share: `Checks(prefix)` counts the conditions that
held and ends the script (exit 1) at the first that does not, naming it
after `prefix`; `raises` checks that a call raises an exception of a
class (and, given `contains`, saying it)."""

import sys


class Checks:
    def __init__(self, prefix):
        self.prefix = prefix
        self.count = 0

    def check(self, cond, what):
        if not cond:
            print(f"{self.prefix}: FAILED: {what}", file=sys.stderr)
            sys.exit(1)
        self.count += 1

    def raises(self, exc, fn, what, contains=None):
        try:
            fn()
        except exc as e:
            self.check(contains is None or contains in str(e), f"{what}: {e!r} says {contains!r}")
            return e
        except Exception as e:  # the wrong exception
            self.check(False, f"{what}: raised {type(e).__name__}: {e}")
        self.check(False, f"{what}: did not raise {exc.__name__}")

    def passed(self):
        """The closing line the tests read."""
        print(f"{self.prefix}: {self.count} passed, 0 failed")
