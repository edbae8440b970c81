"""The Python checks' tally: check() prints "ok WHAT" or "FAIL WHAT[: DETAIL]"
and counts, summary() prints "N passed, N failed" like the C tests and gives
the exit status (1 when anything failed)."""

_passed = _failed = 0


def check(cond, what, detail=""):
    global _passed, _failed
    if cond:
        _passed += 1
        print(f"ok {what}")
    else:
        _failed += 1
        print(f"FAIL {what}{': ' + detail if detail else ''}")
    return bool(cond)


def summary():
    print(f"{_passed} passed, {_failed} failed")
    return 1 if _failed else 0
