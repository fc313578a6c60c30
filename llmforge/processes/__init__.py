"""Processes below every job that starts ranks (training and ``llmforge calibrate``
alike): torchrun in this process and its cluster options (``torchrun``), ranks that die
with their launcher and the failure report (``watch``), and what each rank runs under so
that an error ends it with one record (``rank_errors``); the loop's progress reports
(``progress``), hangs found and explained from them (``hang``, ``dumps``) and shared across
nodes (``nodes``). It knows no plan.
"""
