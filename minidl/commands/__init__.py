"""The commands of the ``minidl`` program, one module each (:mod:`minidl.cli` parses the command
line and reports errors): :func:`~minidl.commands.train.cmd_train`,
:func:`~minidl.commands.plan.cmd_plan`, :func:`~minidl.commands.bench.cmd_bench`."""
