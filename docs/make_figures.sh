#!/bin/sh
# Regenerate the figures of docs/plots.md from samples/ with qgcli itself (run from the repository root).
# The screenshots (the HTML report, TensorBoard): python docs/make_screenshots.py
set -e
qgcli plot staircase samples/notebook.h5 --num-bits 2 -o docs/notebook_staircase.png --force -q
qgcli plot ste samples/notebook.h5 --num-bits 2 -o docs/notebook_ste.png --force -q
qgcli plot ste samples/notebook.h5 --num-bits 2 --gradients samples/notebook.h5:gradients \
    -o docs/notebook_ste_backprop.png --force -q
qgcli plot hist samples/notebook.h5 --num-bits 2 -o docs/notebook_hist.png --force -q
qgcli plot channels samples/per_channel.h5 -o docs/per_channel.png --force -q
qgcli plot staircase samples/notebook.h5 --variant quantize-dequantize --dtype quint8 \
    -o docs/notebook_quantize_dequantize.png --force -q
qgcli plot estimators --inputs samples/notebook.h5:inputs --min -6 --max 6 --variant quantize-dequantize \
    --dtype quint8 -e scaled:0.9 -o docs/notebook_custom_gradient.png --force -q
qgcli plot estimators samples/notebook.h5 --num-bits 2 -e ste -e pact -e scaled:0.9 -e ewgs:1 \
    -o docs/notebook_estimators.png --force -q
qgcli plot layers samples/run.h5 -o docs/run_layers.png --force -q
