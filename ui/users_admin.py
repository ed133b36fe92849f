"""Users on the admin page (with --auth): list them with their last sign-in, tokens and
conversations; add one with a set or a generated password; disable and enable; reset a
password; grant and revoke the admin role; revoke a user's API keys. The users file stays the
store (the CLI `python -m ui.auth` keeps working on it, and the server reads it again whenever
its bytes change), so a change counts at once: a disabled user's sign-ins and keys stop on
their next request, a reset password ends the sign-ins made with the old one. Every change is
recorded in SQLite (`user_changes`) and logged."""

from __future__ import annotations

import secrets
from dataclasses import replace

import gradio as gr
import pandas as pd

from sessions import SessionManager
from sessions.api_keys import ApiKeys
from ui.admin_tables import clock
from ui.auth import User, UsersFile, check_name, check_password, hash_password

COLUMNS = ["user", "role", "state", "last sign-in", "conversations", "reply tokens",
           "tokens this minute", "API keys"]  # fmt: skip


class UsersAdmin:
    """The admin page's user operations; each returns what the page says (an error starts
    with "Error:")."""

    def __init__(self, users: UsersFile, keys: ApiKeys, sessions: SessionManager) -> None:
        self.users = users
        self.keys = keys
        self.sessions = sessions
        self.records = sessions.store.users

    def table(self) -> pd.DataFrame:
        users = self.users.all()
        signed = self.records.last_sign_ins()
        totals = self.records.totals()
        active: dict[str, int] = {}
        for key in self.keys.list(None):
            if not key["revoked"]:
                active[key["owner"]] = active.get(key["owner"], 0) + 1
        rows = []
        for name, u in sorted(users.items()):
            owner = f"user:{name}"
            used, reserved, _ = self.sessions.limiter.standing(owner)
            conversations, tokens = totals.get(owner, (0, 0))
            rows.append(
                [
                    name,
                    u.role,
                    "disabled" if u.disabled else "active",
                    clock(signed.get(name)),
                    conversations,
                    tokens,
                    used + reserved,
                    active.get(owner, 0),
                ]  # fmt: skip
            )
        return pd.DataFrame(rows, columns=COLUMNS)

    def changes(self) -> pd.DataFrame:
        rows = [
            [clock(c["at"]), c["actor"], c["user"], c["action"]] for c in self.records.changes()
        ]
        return pd.DataFrame(rows, columns=["when", "by", "user", "change"])

    def _change(self, actor: str, name: str, action: str, edit) -> str:  # noqa: ANN001
        """Apply `edit(users, name)` (it returns what to say, or raises ValueError with what
        is wrong) to the file under its lock (`UsersFile.edit`: the last active admin stays),
        write it whole, record the change."""
        name = (name or "").strip()
        try:
            said = self.users.edit(lambda users: edit(users, name))
        except ValueError as e:
            return f"Error: {e}"
        self.records.changed(actor, name, action)
        return said

    def _existing(self, users: dict[str, User], name: str) -> User:
        if name not in users:
            raise ValueError(f"there is no user {name!r}")
        return users[name]

    def add(self, actor: str, name: str, password: str) -> str:
        """A new user with `password`, or a generated one (shown once) if it is empty."""
        chosen = password or secrets.token_urlsafe(12)

        def edit(users: dict[str, User], name: str) -> str:
            problem = check_name(name) or check_password(chosen)
            if problem:
                raise ValueError(problem)
            if name in users:
                raise ValueError(f"{name} exists: reset their password instead")
            users[name] = User(name, hash_password(chosen))
            if password:
                return f"Added {name} with the password you set."
            return f"Added {name}. Their password, shown this once: `{chosen}`"

        return self._change(actor, name, "added", edit)

    def reset_password(self, actor: str, name: str, password: str) -> str:
        """A new password (set, or generated and shown once): their sign-ins end at once."""
        chosen = password or secrets.token_urlsafe(12)

        def edit(users: dict[str, User], name: str) -> str:
            user = self._existing(users, name)
            problem = check_password(chosen)
            if problem:
                raise ValueError(problem)
            users[name] = replace(user, hash=hash_password(chosen))
            shown = "the password you set" if password else f"this once: `{chosen}`"
            return f"{name}'s password is reset ({shown}); their sign-ins have ended."

        return self._change(actor, name, "reset the password of", edit)

    def set_disabled(self, actor: str, name: str, disabled: bool) -> str:
        """Disable (their sign-ins and replies in progress stop, their API keys are revoked)
        or enable a user (with none of their old sign-ins or keys: they sign in again and
        make new keys)."""

        def edit(users: dict[str, User], name: str) -> str:
            user = self._existing(users, name)
            if disabled and name == actor:
                raise ValueError("you cannot disable yourself")
            users[name] = replace(user, disabled=disabled)
            return f"{name} is {'disabled' if disabled else 'enabled'}."

        said = self._change(actor, name, "disabled" if disabled else "enabled", edit)
        if disabled and not said.startswith("Error"):
            owner = f"user:{name.strip()}"
            revoked = self.keys.revoke_all(owner)
            self.sessions.stop_owner(owner)  # replies in progress end now, one-off ones too
            if revoked:
                said += f" {revoked} API key{'s' * (revoked != 1)} revoked."
        return said

    def set_admin(self, actor: str, name: str, admin: bool) -> str:
        def edit(users: dict[str, User], name: str) -> str:
            user = self._existing(users, name)
            if not admin and name == actor:
                raise ValueError("you cannot take your own admin role")
            users[name] = replace(user, role="admin" if admin else "user")
            return f"{name} is {'an admin' if admin else 'no longer an admin'}."

        return self._change(actor, name, "granted admin to" if admin else "revoked admin of", edit)

    def revoke_keys(self, actor: str, name: str) -> str:
        name = (name or "").strip()
        if name not in self.users.all():
            return f"Error: there is no user {name!r}"
        n = self.keys.revoke_all(f"user:{name}")
        self.records.changed(actor, name, f"revoked {n} API keys of")
        return f"Revoked {n} API key{'s' * (n != 1)} of {name}."


def build_users_section(admin: UsersAdmin) -> None:
    """The Users section of the admin page (inside its Blocks)."""
    with gr.Accordion("Users", open=True, elem_id="users"):
        table = gr.Dataframe(value=admin.table, interactive=False, elem_id="users-table")
        with gr.Row():
            name = gr.Textbox(label="User name", scale=2, elem_id="user-name")
            password = gr.Textbox(
                label="Password (empty: a generated one, shown once)",
                type="password",
                scale=2,
                elem_id="user-password",
            )
        with gr.Row():
            buttons = {
                "add": gr.Button("Add user", size="sm", variant="primary", elem_id="user-add"),
                "reset": gr.Button("Reset password", size="sm", elem_id="user-reset"),
                "disable": gr.Button("Disable", size="sm", variant="stop", elem_id="user-disable"),
                "enable": gr.Button("Enable", size="sm", elem_id="user-enable"),
                "grant": gr.Button("Make admin", size="sm", elem_id="user-grant"),
                "revoke_admin": gr.Button("Remove admin", size="sm", elem_id="user-ungrant"),
                "keys": gr.Button("Revoke API keys", size="sm", elem_id="user-keys"),
            }
            refresh = gr.Button("Refresh", size="sm")
        said = gr.Markdown(elem_id="user-said")
        log = gr.Dataframe(value=admin.changes, label="Changes", interactive=False)

    actions = {
        "add": lambda a, n, p: admin.add(a, n, p),
        "reset": lambda a, n, p: admin.reset_password(a, n, p),
        "disable": lambda a, n, p: admin.set_disabled(a, n, True),
        "enable": lambda a, n, p: admin.set_disabled(a, n, False),
        "grant": lambda a, n, p: admin.set_admin(a, n, True),
        "revoke_admin": lambda a, n, p: admin.set_admin(a, n, False),
        "keys": lambda a, n, p: admin.revoke_keys(a, n),
    }
    for key, button in buttons.items():

        def run(n: str, p: str, request: gr.Request, act=actions[key]):  # noqa: ANN001, ANN202
            actor = getattr(request, "username", None) or "admin"
            return act(actor, n, p), "", admin.table(), admin.changes()

        button.click(run, [name, password], [said, password, table, log], concurrency_limit=None)
    refresh.click(lambda: (admin.table(), admin.changes()), None, [table, log])
