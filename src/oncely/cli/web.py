"""``oncely web``: serve the operator's console (``pip install 'oncely[web]'``).

Exit codes: 0 stopped by SIGTERM or SIGINT; 2 it could not start (no credentials and no
``--no-auth`` on localhost, the web extra missing, a busy port, an --app that does not load).
"""

from __future__ import annotations

import ipaddress
from typing import Annotated

import typer

from oncely.cli._imports import load_app
from oncely.cli._options import AppOption, DatabaseUrl, settings_epilog
from oncely.errors import ConfigurationError
from oncely.settings import KafkaSettings, WebSettings

app = typer.Typer()

#: The console's port in the port plan (relay 9400, consumers 9401, task worker 9402).
PORT = 9403


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@app.command(name="web", epilog=settings_epilog(WebSettings, "console"))
def web(
    database_url: DatabaseUrl,
    app_target: AppOption = None,
    bootstrap_servers: Annotated[
        str | None,
        typer.Option(
            "--bootstrap-servers",
            envvar="ONCELY_KAFKA_BOOTSTRAP_SERVERS",
            help="Kafka, for lag, DLQ depth, publish rate, an event's record and republish "
            "(without: the database only).",
            show_default=False,
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.", min=1, max=65535)] = PORT,
    no_auth: Annotated[
        bool,
        typer.Option(
            "--no-auth", help="Serve without a password: only on a loopback --host (127.0.0.1)."
        ),
    ] = False,
) -> None:
    """Serve the console: the pipeline's state, any event end to end, and the operator's
    actions (requeue, skip, reclaim, republish), each shown as a dry run first and audited.

    Needs ONCELY_WEB_USER and ONCELY_WEB_PASSWORD (Basic auth), unless bound to a loopback
    address with --no-auth. ONCELY_WEB_READ_ONLY=true serves no action at all.
    """
    try:
        import uvicorn

        from oncely.web import Console, basic_auth
        from oncely.web import no_auth as without_auth
    except ImportError as exc:
        raise ConfigurationError(
            f"the console needs the web extra ({exc.name} is missing): pip install 'oncely[web]'"
        ) from None
    import sqlalchemy as sa

    from oncely.schemas.codec import Codec

    settings = WebSettings()
    if no_auth:
        if not _loopback(host):
            raise typer.BadParameter(
                f"--no-auth serves the console to anyone who reaches {host}: bind a loopback "
                "address (--host 127.0.0.1) or set ONCELY_WEB_USER and ONCELY_WEB_PASSWORD",
                param_hint="--no-auth",
            )
        authenticate = without_auth
    elif settings.user is None or settings.password is None:
        raise ConfigurationError(
            "the console needs ONCELY_WEB_USER and ONCELY_WEB_PASSWORD (Basic auth); on a "
            "loopback --host, --no-auth serves it without them"
        )
    else:
        authenticate = basic_auth(settings)
    loaded = load_app(app_target) if app_target is not None else None
    registry = loaded.registry if loaded is not None else None
    console = Console(
        engine=sa.create_engine(database_url, pool_pre_ping=True),
        settings=settings,
        effects=loaded.effects if loaded is not None else None,
        codec=Codec(registry=registry) if registry is not None else None,
        kafka=None
        if bootstrap_servers is None
        else KafkaSettings(bootstrap_servers=bootstrap_servers),
        app_target=app_target or "<module:app>",
    )
    uvicorn.run(console.app(authenticate), host=host, port=port, log_level="info")
