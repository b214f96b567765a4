"""The shim's clients to the engine: the relay's pool and an aiohttp session for the rest.

Proxied requests go through :class:`~llm_backoff_shim.http.upstream_http.UpstreamPool`, a lean
HTTP/1.1 client written for the relay (its docstring says why, with the measurement).
Readiness probes and engine-metrics scrapes, a few requests a second at most, use
aiohttp (measured the cheapest per request among httpx, httpx2 and aiohttp on loopback;
the comparison is in git history, bench/bench_upstream_clients.py at 658ce04).

Defaults of general-purpose clients that do not fit LLM traffic, and what we set (the
relay's pool follows the same rules):

- pool limit (aiohttp: 100 connections): unlimited here, because admission already
  caps generation requests and a pool cap would only add a second, hidden queue;
- total timeout (aiohttp: 300 s): none; a long generation is not an error. Instead a
  connect timeout and a per-read timeout (silence mid-response) apply;
- keep-alive expiry (aiohttp: 15 s): below the upstream's own idle timeout (uvicorn,
  which vLLM uses, closes idle connections after 5 s), so we never send a request
  on a socket the upstream is closing;
- automatic decompression and automatic headers (User-Agent, Accept-Encoding,
  Content-Type) are off: bytes and headers pass through as the two ends sent them;
- no cookie jar: a Set-Cookie from the upstream must never be replayed for another
  client; no redirects followed, no proxy settings from the environment.
"""

from __future__ import annotations

import aiohttp

from llm_backoff_shim.http.upstream_http import UpstreamPool, parse_origin

_SKIP_AUTO_HEADERS = ("User-Agent", "Accept-Encoding", "Accept", "Content-Type")


class UpstreamClient:
    """The relay's pool and one aiohttp session per app, opened and closed by the app's lifespan."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout: float = 5.0,
        read_timeout: float | None = 600.0,
        keepalive: float = 4.0,
        stream_read_timeout: float | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._stream_read_timeout = stream_read_timeout
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._keepalive = keepalive
        self._session: aiohttp.ClientSession | None = None
        self._pool: UpstreamPool | None = None
        parse_origin(self.base_url)  # a base URL the relay cannot use fails here, not at start-up

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("upstream client is not open (is the app's lifespan running?)")
        return self._session

    @property
    def pool(self) -> UpstreamPool:
        if self._pool is None:
            raise RuntimeError("upstream client is not open (is the app's lifespan running?)")
        return self._pool

    async def open(self) -> None:
        if self._session is not None:
            return
        self._pool = UpstreamPool(
            self.base_url,
            connect_timeout=self._connect_timeout,
            read_timeout=self._read_timeout,
            keepalive=self._keepalive,
            stream_read_timeout=self._stream_read_timeout,
        )
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=self._keepalive)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=self._connect_timeout, sock_read=self._read_timeout
            ),
            auto_decompress=False,
            skip_auto_headers=_SKIP_AUTO_HEADERS,
            cookie_jar=aiohttp.DummyCookieJar(),
            trust_env=False,
        )

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def ready(self, path: str, timeout: float = 2.0) -> tuple[bool, str]:
        """Whether ``GET base+path`` answers 2xx within ``timeout`` s, and a short reason."""
        try:
            async with self.session.get(
                self.base_url + path,
                timeout=aiohttp.ClientTimeout(total=timeout),
                allow_redirects=False,
            ) as response:
                await response.read()
                if 200 <= response.status < 300:
                    return True, f"upstream answered {response.status}"
                return False, f"upstream answered {response.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            return False, f"upstream unreachable: {type(exc).__name__}"
