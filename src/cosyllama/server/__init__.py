"""The serving side: the HTTP app (:mod:`.app`) with its routes (:mod:`.speech`, :mod:`.voices`), errors,
access checks, wire formats, connection limits and web page, the serving core both servers share
(:mod:`.serving`) and the Wyoming server (:mod:`.wyoming`). Needs the ``server`` or ``wyoming`` extra."""
