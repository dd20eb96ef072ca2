"""Recurrent layers: the fused GRU / LSTM over a sequence (``fused``, with its two backward
paths ``keep_all`` and ``scheduled`` and their shared ``units``), and the unrolled pieces
(``LSTMCell``, ``GRUCell``, ``RNNInputProjection``, ``ZeroState``, ``TimeStack``)."""
