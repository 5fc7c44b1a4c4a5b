"""Starting a `Service` (`server.py`): in its own thread (tests, benchmarks, examples) or in the
foreground (`launch/serve.py`)."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web


def _check_ready(runner) -> int:
    return runner.addresses[0][1]


class Running:
    """A server on its own event-loop thread (tests, benchmarks): `.url`, `.stop()`."""

    def __init__(self, service, host: str = "127.0.0.1", port: int = 0):
        self.service, self._loop = service, asyncio.new_event_loop()
        started = threading.Event()

        async def start():
            # a short grace: stop() cuts held-open polls as a crash would (the SDK reconnects)
            self._runner = web.AppRunner(service.app(), access_log=None, shutdown_timeout=0.5)
            await self._runner.setup()
            await web.TCPSite(self._runner, host, port).start()
            self.url = f"http://{host}:{_check_ready(self._runner)}"
            started.set()

        self._thread = threading.Thread(
            target=lambda: (self._loop.run_until_complete(start()), self._loop.run_forever()),
            daemon=True)
        self._thread.start()
        if not started.wait(30):
            raise RuntimeError("the service did not start within 30 s")

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self.service.worker.shutdown(wait=False, cancel_futures=True)


def serve(service, host: str, port: int) -> None:
    """Serve until interrupted; print the URL once requests are accepted."""

    async def main():
        runner = web.AppRunner(service.app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        print(f"jaxrl service: http://{host}:{_check_ready(runner)}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass

