"""The browser page (Gradio): `controls` (the settings table), `handlers` (each event asks the chat service and
renders its answer with `chat.view`), `layout` (the components and their wiring). Imports chat; chat never
imports it.
"""

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # (before gradio is imported: it reads this once)
