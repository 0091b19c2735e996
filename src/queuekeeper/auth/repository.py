"""The user an API token belongs to, and what its broker logins must hold now."""

from __future__ import annotations

import uuid

from sqlalchemy import bindparam, select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from queuekeeper import db
from queuekeeper.auth.tokens import token_digest
from queuekeeper.models import User, utcnow

# Every authenticated agent call runs it: built once, read in autocommit (`db.read_one`).
USER_WITH_TOKEN = select(*db.columns_of(User)).where(User.token_hash == bindparam("digest"))


async def user_with_token(engine: AsyncEngine, token: str) -> User | None:
    """One indexed lookup: tokens are stored as their digest, unique per user. The user is
    detached: a route's session takes it with `merge(user, load=False)`."""
    row = await db.read_one(engine, USER_WITH_TOKEN, {"digest": token_digest(token)})
    return db.detached(User, row) if row is not None else None


class UserGone(Exception):
    """The user was deleted (by the backend) while one of its calls was in flight."""


async def login_hash_now(session: AsyncSession, user_uuid: uuid.UUID) -> str | None:
    """The password hash the user's broker users must hold now, read afresh (not from the
    request's user): its token's, or None while it is inactive or its token expired.

    Read under the owner lock (locks.user_key) by every writer of broker passwords, so a
    token change committed before the lock was taken is what reaches the broker
    (docs/decisions/002-owner-lock.md). UserGone when the row is gone."""
    row = (
        await session.execute(
            select(User.uuid, User.broker_login_hash_sql(utcnow())).where(User.uuid == user_uuid)
        )
    ).first()
    if row is None:
        raise UserGone(user_uuid.hex)
    value: str | None = row[1]
    return value
