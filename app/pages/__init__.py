"""The window's pages, one module each: model, data, recipe, run, runs, chat, export, speed, hardware, gpu_setup."""
