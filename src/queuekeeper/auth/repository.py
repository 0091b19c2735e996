"""The one query authentication needs: the user an API token belongs to."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from queuekeeper.auth.tokens import token_digest
from queuekeeper.models import User


async def user_with_token(session: AsyncSession, token: str) -> User | None:
    """One indexed lookup: tokens are stored as their digest, unique per user."""
    user: User | None = await session.scalar(
        select(User).where(User.token_hash == token_digest(token))
    )
    return user
