"""Access control: the policy (who may read and write what), authentication of an
Authorization header, JWT verification. No aiohttp: the middleware is shared/http/auth.py."""
