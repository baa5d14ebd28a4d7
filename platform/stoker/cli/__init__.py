"""The `stoker` command line: parse flags into values and call one function. One module per command
group, each with `register(sub)`; `stoker.cli.main` lists them and dispatches. Commands that talk to
a running platform go through `stoker.cli.admin_client` (HTTP), never through its objects; commands
that run a process (`up`, `controller`, `gateway`, `engine`, `node`) hand their values to
`stoker.serve`, `stoker.engine` or `stoker.node`.

May import: everything below it. Imported by: nothing of ours (it is the top).
"""
