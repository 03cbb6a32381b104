"""The trainer's program (``pretrain_gpt.py`` is a few lines over it), one module per step:

==================  ====================================================================================
module              step
==================  ====================================================================================
``arguments``       the parser, config files and the flag reference, generated from the config sections
``job``             parse: every source of settings -> a validated job
``preflight``       the files and the machine the run will use, checked
``plan``            ``--memory-budget-gib``: the memory planner's choice
``run``             build (topology, chunks, engine, data) and train
``main``            the steps in order, and the exit and error policy
``launcher``        the error line as torchrun reports it
==================  ====================================================================================

The program is :mod:`megazero.cli.main` (``main``, ``run_program``, ``exit_process``).
"""
