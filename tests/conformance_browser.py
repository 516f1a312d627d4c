"""A headless stand-in for a person's browser during `login` ($BROWSER runs it with the URL).
Like a real browser's launcher it returns at once and the page loads on its own: it opens the
authorization URL and follows its redirects, the last of which reaches the loopback port
`login` listens on, as a browser would after the person consented.

    python3 conformance_browser.py URL
"""

import subprocess
import sys
import urllib.request

if sys.argv[1] != "-navigate":
    subprocess.Popen([sys.executable, __file__, "-navigate", sys.argv[1]], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL)
else:
    with urllib.request.urlopen(sys.argv[2], timeout=60) as page:
        page.read()
