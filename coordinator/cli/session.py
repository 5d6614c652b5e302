"""`lockgate session new`: a session on a running gateway, created through its admin API and
printed as the variables an OpenAI SDK reads (`export $(lockgate session new)`)."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from pydantic import ValidationError

from lockgate.coordinator.cli.options import Subcommands, load_run_config
from lockgate.coordinator.config import GatewaySection
from lockgate.coordinator.errors import RunFailed, UsageError
from lockgate.coordinator.launch.parts import admin_token_of
from lockgate.gateway.schema import CreatedSession


def add_parser(sub: Subcommands) -> None:
    session = sub.add_parser("session", help="sessions on a running gateway")
    actions = session.add_subparsers(dest="action", required=True)
    new = actions.add_parser(
        "new",
        help="create a session; print its OpenAI base URL and key",
        description="Create a session through the gateway's admin API (the admin token from "
        "$LOCKGATE_ADMIN_TOKEN) and print OPENAI_BASE_URL=, OPENAI_API_KEY= and "
        "LOCKGATE_SESSION_ID= lines: `export $(lockgate session new)` points any OpenAI SDK "
        "at it.",
    )
    new.add_argument("--gateway", help="gateway URL (default: $LOCKGATE_GATEWAY__URL)")
    new.add_argument("--task-id", default="manual", help="the session's task id")
    new.add_argument("--group-id", help="the session's group id (a GRPO group)")
    new.add_argument("--metadata", default="{}", help="a JSON object stored with the session")
    new.add_argument("--json", action="store_true", help="print the created session as JSON")
    new.set_defaults(handler=run_new)


def run_new(args: argparse.Namespace) -> int:
    section = load_run_config(None, []).gateway  # the LOCKGATE_GATEWAY__* variables
    if args.gateway is not None:
        try:
            section = GatewaySection.model_validate({**section.model_dump(), "url": args.gateway})
        except ValidationError as exc:
            raise UsageError(f"--gateway: {exc.errors()[0]['msg']}") from None
    if section.url is None:
        raise UsageError(
            "session new needs the gateway's URL: --gateway URL or $LOCKGATE_GATEWAY__URL"
        )
    token = admin_token_of(section)
    if token is None:
        raise UsageError(
            f"session new needs the gateway's admin token in ${section.admin_token_env}"
        )
    try:
        metadata: Any = json.loads(args.metadata)
    except ValueError as exc:
        raise UsageError(f"--metadata: not JSON ({exc})") from None
    if not isinstance(metadata, dict):
        raise UsageError("--metadata: must be a JSON object")
    created = asyncio.run(_create_session(section.url, token, args, metadata))
    if args.json:
        print(created.model_dump_json())
    else:
        print(f"OPENAI_BASE_URL={created.base_url}", flush=True)
        print(f"OPENAI_API_KEY={created.api_key}", flush=True)
        print(f"LOCKGATE_SESSION_ID={created.session_id}", flush=True)
    return 0


async def _create_session(
    url: str, token: str, args: argparse.Namespace, metadata: dict[str, Any]
) -> CreatedSession:
    """The created session; the gateway client's errors as the command's."""
    import httpx

    from lockgate.gateway.client import GatewayClient, GatewayClientError

    try:
        async with GatewayClient(url, token, timeout=30.0) as client:
            return await client.create_session(args.task_id, args.group_id, metadata)
    except GatewayClientError as exc:
        if exc.status_code == 401:
            raise UsageError(f"the gateway at {url} refused the admin token") from None
        raise UsageError(f"the gateway at {url} refused the session: {exc.message}") from None
    except httpx.HTTPError as exc:
        raise RunFailed(
            f"cannot reach the gateway at {url} ({type(exc).__name__}: {exc})"
        ) from None
