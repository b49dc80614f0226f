"""What ``bench/fidelity.py reference`` and ``make-random-eagle3`` run, inside the SafeAILab EAGLE reference's own
environment (torch CPU, transformers 4.53.1: the reference does not run under transformers 5.x). eagle_ray is not
installed there, so nothing here imports eagle_ray or bench's other modules (which do); only torch, transformers,
safetensors and, at run time, ``eagle.model`` from a reference checkout."""
