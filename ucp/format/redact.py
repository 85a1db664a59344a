"""URLs as ucp shows them: without the secrets a URL can carry. The one function every message, log line and
index entry that names a URL goes through (`ObjectPath.__str__`, the CLI's error and note lines).

A URL can hold credentials in its user info (`s3://KEY:SECRET@bucket/x`, `http://user:SECRET@host/x`) and in
its query (a signed URL's `X-Amz-Signature`, `X-Amz-Credential`, `X-Amz-Security-Token`; Azure's `sig`; generic
`token`, `signature`, `key`, `password` parameters). Those are replaced by `***`; everything else, the part that
tells the user which file is meant, stays.
"""
from __future__ import annotations

import re

MASK = "***"
# scheme://USERINFO@ : the user info runs to the netloc's last "@" (a password may hold an unescaped "@").
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/?#\s]*@")
# ?NAME=VALUE or &NAME=VALUE where NAME says it is a secret; the value runs to the next parameter or space.
_SECRET_PARAM = re.compile(r"([?&;][^=&?#;\s]*(?:sig|token|credential|secret|passw|pwd|key|auth)[^=&?#;\s]*=)"
                           r"[^&#;\s]*", re.IGNORECASE)


def redact(text: str) -> str:
    """`text` (a URL, or a message naming any number of them) with every URL's user info and secret query
    values replaced by `***`. Text without a URL comes back unchanged."""
    if "://" not in text and "?" not in text:
        return text
    return _SECRET_PARAM.sub(lambda m: m.group(1) + MASK, _USERINFO.sub(lambda m: m.group(1) + MASK + "@", text))
