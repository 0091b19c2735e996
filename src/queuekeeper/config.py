"""Settings, read from `QUEUEKEEPER_*` environment variables (and `.env`).

Every field here is documented in the README's configuration table; a test
checks that the two agree.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Annotated

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="QUEUEKEEPER_", env_file=".env", extra="ignore", populate_by_name=True
    )

    # --- identity of this installation -----------------------------------------------
    instance_name: str = Field(
        default="queuekeeper",
        description="Vhosts and broker users are tagged `queuekeeper:<instance_name>`; "
        "queuekeeper only ever touches objects carrying its own tag.",
    )

    # --- connections ---------------------------------------------------------------
    database_url: str = Field(
        default="sqlite+aiosqlite:///./queuekeeper.db",
        description="SQLAlchemy URL. `postgresql://` and `sqlite:///` are given their "
        "async drivers (asyncpg, aiosqlite) automatically.",
    )
    database_pool_size: int = Field(default=10, ge=1)
    amqp_url: str = Field(
        default="amqp://guest:guest@127.0.0.1:5672/",
        validation_alias=AliasChoices("QUEUEKEEPER_AMQP_URL", "RABBIT_URL", "amqp_url"),
        description="AMQP connection string; `RABBIT_URL` is used when this is not set. "
        "The path (vhost) is ignored: queuekeeper connects to each user vhost.",
    )
    management_url: str = "http://127.0.0.1:15672"
    management_user: str = "guest"
    management_password: str = "guest"
    management_timeout: float = Field(default=5.0, gt=0, description="Seconds per call.")
    tls_ca_file: str | None = Field(
        default=None, description="CA bundle for `amqps://` and an `https://` Management API."
    )
    tls_cert_file: str | None = Field(default=None, description="Client certificate (PEM).")
    tls_key_file: str | None = Field(default=None, description="Client certificate key (PEM).")
    tls_verify: bool = Field(
        default=True, description="Certificate checks; switch off only for testing."
    )

    # --- HTTP -----------------------------------------------------------------------------
    service_tokens: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated service tokens for /api/internal and /api/admin "
        "(several, for rotation).",
    )
    public_url: str = Field(
        default="http://127.0.0.1:8000",
        description="Base of the `url` fields in responses (include any path prefix).",
    )
    root_path: str = Field(
        default="",
        description="Path prefix the service is mounted under behind a proxy, e.g. `/qk`.",
    )
    host: str = "127.0.0.1"
    port: int = 8000
    retry_after_seconds: int = Field(
        default=5, ge=1, description="`Retry-After` sent with a 503 when the broker is down."
    )

    # --- queue arguments (SPEC 3) -------------------------------------------------------
    queue_message_ttl_ms: int = Field(default=3_600_000, ge=0)
    queue_max_length: int = Field(default=10_000, ge=1)
    queue_overflow: str = "reject-publish-dlx"
    dead_letter_exchange: str = ""
    dlq_name: str = "waldur.dlq.messages"
    dlq_max_length: int = Field(default=100_000, ge=1)
    dlq_message_ttl_ms: int = Field(default=7 * 24 * 3_600_000, ge=0)
    dlq_overflow: str = "drop-head"

    # --- reconcile, stale cleanup, dead-letter redrive (SPEC 7) -----------------------------
    scheduler_enabled: bool = Field(
        default=True,
        description="Run the scheduled jobs in this process. Switch off on replicas that "
        "should only serve requests; with it on everywhere, an advisory lock still lets one "
        "run at a time.",
    )
    scheduler_jitter_seconds: int = Field(
        default=60, ge=0, description="Random shift of each scheduled run, so replicas spread out."
    )
    reconcile_interval_seconds: int = Field(
        default=6 * 3600, ge=1, description="Seconds between scheduled reconcile runs."
    )
    stale_cleanup_interval_seconds: int = Field(
        default=24 * 3600, ge=1, description="Seconds between scheduled stale-subscription runs."
    )
    redrive_interval_seconds: int = Field(
        default=0,
        ge=0,
        description="Seconds between scheduled dead-letter redrives; 0 = only on demand.",
    )
    reconcile_page_size: int = Field(
        default=500, ge=1, le=500, description="Queues per Management API page (broker max 500)."
    )
    redrive_max_age_seconds: int = Field(
        default=24 * 3600,
        ge=1,
        description="A dead letter older than this (from its publish time) is given up.",
    )
    redrive_max_attempts: int = Field(
        default=5, ge=1, description="A dead letter redriven this many times is given up."
    )
    redrive_max_messages: int = Field(
        default=10_000,
        ge=1,
        description="Dead letters examined per vhost per redrive run (bounds memory).",
    )

    @field_validator("service_tokens", mode="before")
    @classmethod
    def _split_tokens(cls, value: object) -> object:
        if isinstance(value, str):
            return [token.strip() for token in value.split(",") if token.strip()]
        return value

    @field_validator("database_url")
    @classmethod
    def _async_driver(cls, value: str) -> str:
        for plain, driver in (
            ("postgresql://", "postgresql+asyncpg://"),
            ("postgres://", "postgresql+asyncpg://"),
            ("sqlite:///", "sqlite+aiosqlite:///"),
        ):
            if value.startswith(plain):
                return driver + value[len(plain) :]
        return value

    @field_validator("root_path")
    @classmethod
    def _normalise_root_path(cls, value: str) -> str:
        value = value.strip().rstrip("/")
        if value and not value.startswith("/"):
            value = "/" + value
        return value

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")

    @property
    def instance_tag(self) -> str:
        return f"queuekeeper:{self.instance_name}"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
