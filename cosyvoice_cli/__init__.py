"""The `async-cosyvoice` command line. It sits above the library (async_cosyvoice) and the
transports (grpc_async): the library never imports it.

    async-cosyvoice serve | synthesize | speakers add|list|show|rm|import|export | bench | batch

`synthesize` and `speakers` run in-process by default and against a server with `--target HOST:PORT`.
"""
