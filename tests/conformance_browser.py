"""A headless stand-in for a person's browser during `login` ($BROWSER runs it with the URL):
it opens the authorization URL and follows its redirects, the last of which reaches the
loopback port `login` listens on, as a browser would after the person consented.

    python3 conformance_browser.py URL
"""

import sys
import urllib.request

with urllib.request.urlopen(sys.argv[1], timeout=60) as page:
    page.read()
