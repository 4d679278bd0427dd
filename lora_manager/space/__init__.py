"""The Gradio Space over an engine (`app.py` starts it): the command line and launch (cli), the Blocks layout
(layout), one function per action for the UI and the API alike (handlers), the Generate form (form), what the pages
show (views), refusals and their HTTP statuses (refusals), the Strategies tab (strategies) and ZeroGPU's decorator
(zerogpu)."""
