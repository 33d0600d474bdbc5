"""The console scripts: ``specjax`` (:mod:`~specjax.cli.main`: ``demo`` and ``generate``),
its subcommands (:mod:`~specjax.cli.demo`, :mod:`~specjax.cli.generate`); ``specjax-convert``
is :mod:`specjax.converters.cli`."""
