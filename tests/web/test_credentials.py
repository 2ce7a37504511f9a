"""The operators' credentials page: join tokens made (shown once), listed and revoked through
the portal's forms, and relay keys listed without their keys; who may see it is
``test_access.py``'s."""

from __future__ import annotations

import re
from html import unescape
from pathlib import Path

from coord_helpers import RELAY_NAMES, relay_key
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from portal_helpers import field_errors, open_portal

from vpool.coordinator import keys

DAY = 86400.0


def _row(html: str, token_id: int) -> str:
    found = re.search(rf'<tr data-join-token="{token_id}">(.*?)</tr>', html, re.S)
    assert found, f"no row of join token {token_id}"
    return unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", found.group(1))).strip())


async def test_join_tokens_are_made_shown_once_used_and_revoked(tmp_path: Path) -> None:
    async with open_portal(tmp_path, open_enrollment=False) as portal:
        pool = portal.pool
        ops = await portal.sign_in("ops", "operator")
        r = await ops.get("/pool/credentials")
        assert r.status_code == 200 and "No join token yet." in r.text
        assert 'id="open-enrollment"' not in r.text
        r = await ops.post_form(
            "/pool/join-tokens", {"label": "lab <machines>", "uses": "2", "expires": "7d"}
        )
        assert r.status_code == 201, field_errors(r.text) or r.text
        shown = re.search(r'<pre class="token">(vpj_[^<]+)</pre>', r.text)
        assert shown, r.text
        token = shown.group(1)
        assert "lab &lt;machines&gt;" in r.text and "it admits 2 agent(s), until" in r.text
        [info] = pool.core.store.list_join_tokens(pool.clock())
        assert (info.label, info.uses_left, info.used) == ("lab <machines>", 2, 0)
        assert info.expires == pool.clock() + 7 * DAY
        # The token admits an agent into this closed pool, and is shown nowhere again.
        agent = await pool.enroll("agent-a", join_token=token)
        assert agent.id
        page = (await ops.get("/pool/credentials")).text
        assert token not in page and keys.hash_token(token) not in page
        assert _row(page, info.id).startswith(f"{info.id} lab <machines> usable 1 1")
        # Revoked: the next volunteer is refused; the row says so and has no button.
        r = await ops.post_form(f"/pool/join-tokens/{info.id}/revoke")
        assert r.status_code == 303 and r.headers["location"] == "/pool/credentials"
        r = await pool.enroll_request(Ed25519PrivateKey.generate(), "agent-b", join_token=token)
        assert r.status_code == 403 and r.json()["error"]["code"] == "bad_join_token"
        page = (await ops.get("/pool/credentials")).text
        assert "revoked" in _row(page, info.id)
        assert f'action="/pool/join-tokens/{info.id}/revoke"' not in page
        # An empty form makes a token for any number of agents, for ever.
        r = await ops.post_form("/pool/join-tokens", {"label": "", "uses": "", "expires": ""})
        assert r.status_code == 201 and "any number of agents, for ever" in r.text
        used_up = pool.core.store.list_join_tokens(pool.clock())[-1]
        assert (used_up.uses_left, used_up.expires) == (None, None)


async def test_bad_join_token_forms_are_field_errors(tmp_path: Path) -> None:
    async with open_portal(tmp_path) as portal:
        ops = await portal.sign_in("ops", "operator")
        bad = [
            ({"uses": "0"}, "uses"),
            ({"uses": "-1"}, "uses"),
            ({"uses": "two"}, "uses"),
            ({"uses": "²"}, "uses"),
            ({"uses": str(2**70)}, "uses"),
            ({"expires": "forever"}, "expires"),
            ({"expires": "0m"}, "expires"),
            ({"expires": "1e400"}, "expires"),
            ({"expires": "99999999w"}, "expires"),
            ({"expires": "7 days"}, "expires"),
            ({"label": "x" * 101}, "label"),
        ]
        for fields, name in bad:
            r = await ops.post_form("/pool/join-tokens", fields)
            assert r.status_code == 422, (fields, r.status_code)
            assert name in field_errors(r.text), (fields, field_errors(r.text))
            assert '<pre class="token">' not in r.text
        assert portal.pool.core.store.list_join_tokens(portal.pool.clock()) == []
        # What was typed comes back, escaped.
        r = await ops.post_form("/pool/join-tokens", {"label": "<b>", "uses": "lots"})
        assert 'value="&lt;b&gt;"' in r.text and 'value="lots"' in r.text
        # Forged forms and unknown tokens: 403, 404, 422; never a 500.
        r = await ops.post_form("/pool/join-tokens", {"csrf": "forged"})
        assert r.status_code == 403
        assert portal.pool.core.store.list_join_tokens(portal.pool.clock()) == []
        assert (await ops.post_form("/pool/join-tokens/99/revoke")).status_code == 404
        assert (await ops.post_form(f"/pool/join-tokens/{2**70}/revoke")).status_code == 422
        assert (await ops.post_form("/pool/join-tokens/x/revoke")).status_code == 422


async def test_relay_keys_are_listed_without_their_keys(tmp_path: Path) -> None:
    async with open_portal(tmp_path) as portal:
        pool = portal.pool
        await pool.register_relay("relay-0", port=7001)
        pool.core.store.revoke_relay_key("relay-3", pool.clock())
        ops = await portal.sign_in("ops", "operator")
        page = (await ops.get("/pool/credentials")).text
        assert 'id="open-enrollment"' in page  # the test pools admit any agent
        rows = dict(re.findall(r'<tr data-relay="([^"]+)">(.*?)</tr>', page, re.S))
        assert sorted(rows) == sorted(RELAY_NAMES)
        assert "127.0.0.1:7001" in rows["relay-0"] and "alive" in rows["relay-0"]
        assert "revoked" in rows["relay-3"] and "never registered" in rows["relay-3"]
        assert "live" in rows["relay-1"]
        for name in RELAY_NAMES:
            assert relay_key(name) not in page and keys.hash_token(relay_key(name)) not in page
