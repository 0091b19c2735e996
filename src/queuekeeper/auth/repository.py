"""The one query authentication needs: the user an API token belongs to."""

from __future__ import annotations

from sqlalchemy import bindparam, select
from sqlalchemy.ext.asyncio import AsyncEngine

from queuekeeper import db
from queuekeeper.auth.tokens import token_digest
from queuekeeper.models import User

# Every authenticated agent call runs it, so it goes on the driver (db.DriverRead).
USER_WITH_TOKEN = db.DriverRead(
    select(*db.columns_of(User)).where(User.token_hash == bindparam("digest"))
)


async def user_with_token(engine: AsyncEngine, token: str) -> User | None:
    """One indexed lookup: tokens are stored as their digest, unique per user. The user is
    detached: a route's session takes it with `merge(user, load=False)`."""
    row = await USER_WITH_TOKEN.first(engine, {"digest": token_digest(token)})
    return db.detached(User, row) if row is not None else None
