"""doors.sign_ins.SignIns as Gradio uses it (login, lookups, logout), on a fake clock and a
users map standing in for the users file; seeded random sequences against a plain model."""

from __future__ import annotations

import random

import pytest

from doors.sign_ins import SignIns


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make() -> tuple[SignIns, Clock, dict[str, str]]:
    clock, passwords = Clock(), {"ann": "h1", "bob": "h2"}
    return SignIns(3600, passwords.get, clock), clock, passwords


def test_a_token_ends_with_its_age_or_its_users_password() -> None:
    tokens, clock, passwords = make()
    tokens["t1"] = "ann"
    tokens["t2"] = "bob"
    assert tokens.get("t1") == "ann" and "t2" in tokens and len(tokens) == 2
    passwords["bob"] = "h3"  # bob's password changed
    assert tokens.get("t2") is None and "t2" not in tokens
    clock.now += 3600
    assert tokens["t1"] == "ann"  # exactly its age: still valid
    clock.now += 1
    assert tokens.get("t1") is None and len(tokens) == 0
    tokens["t4"] = "ann"
    assert tokens["t4"] == "ann"
    del passwords["ann"]  # a removed user's token is no longer valid either
    assert tokens.get("t4") is None
    with pytest.raises(KeyError):
        tokens["nope"]


def test_gradios_logout_loop_skips_ended_tokens() -> None:
    tokens, clock, passwords = make()
    tokens["old"] = "ann"
    clock.now += 1800
    tokens["new"] = "ann"
    tokens["bobs"] = "bob"
    clock.now += 1801  # "old" has ended, "new" has not
    for token in list(tokens.keys()):  # gradio/routes.py logout(all_session=True)
        if tokens[token] == "ann":
            del tokens[token]
    assert list(tokens) == ["bobs"]


@pytest.mark.parametrize("seed", range(5))
def test_random_sign_ins_match_a_plain_model(seed: int) -> None:
    rng = random.Random(seed)
    tokens, clock, passwords = make()
    model: dict[str, tuple[str, float, str | None]] = {}
    for step in range(400):
        op = rng.random()
        if op < 0.3:
            name = rng.choice(["ann", "bob"])
            tokens[f"t{step}"] = name
            model[f"t{step}"] = (name, clock.now, passwords.get(name))
        elif op < 0.4:
            passwords[rng.choice(["ann", "bob"])] = f"h{step}"
        elif op < 0.6:
            clock.now += rng.choice([1, 60, 600, 1800])
        elif op < 0.7 and model:
            t = rng.choice(sorted(model))
            tokens.pop(t, None)
            model.pop(t)
        for t, (name, at, pw) in list(model.items()):
            valid = clock.now - at <= 3600 and passwords.get(name) == pw
            assert tokens.get(t) == (name if valid else None), (seed, step, t)
            if not valid:
                model.pop(t)
        assert sorted(tokens) == sorted(model)
