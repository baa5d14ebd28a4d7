"""The three process shapes, each wired in one function: `stoker up` (both planes in one process),
`stoker controller` and `stoker gateway`. This is the composition root: it builds the objects and
hands them to each other; nothing is patched onto an object after it is built.

May import: everything below it (`stoker.api`, `stoker.control`, `stoker.gateway`, `stoker.engine`,
`stoker.node`, `stoker.spec`). Imported by: `stoker.cli`.
"""
