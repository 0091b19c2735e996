"""The one query authentication needs: the user an API token belongs to."""

from __future__ import annotations

from sqlalchemy import bindparam, select
from sqlalchemy.ext.asyncio import AsyncSession

from queuekeeper.auth.tokens import token_digest
from queuekeeper.models import User

# Built once (every authenticated call runs it): SQLAlchemy then skips constructing the
# statement and its cache key per call.
USER_WITH_TOKEN = select(User).where(User.token_hash == bindparam("digest"))


async def user_with_token(session: AsyncSession, token: str) -> User | None:
    """One indexed lookup: tokens are stored as their digest, unique per user."""
    user: User | None = await session.scalar(USER_WITH_TOKEN, {"digest": token_digest(token)})
    return user
