"""What the results say: memory calibration (``calibrate``) with its fragmentation term
(``fragmentation``), step-time calibration (``steptime``), calibration profiles (``profile``), figures
(``plots``) and the study report (``report``).

May import: harness.spec, harness.estimate, harness.runner.record, harness.sweep.store; pandas,
scikit-learn, matplotlib; never torch.
"""
