"""Adapters as data: where a file comes from (sources), what it holds (reader, inspection), whether the template can
take it (validate), the byte-bounded CPU cache (store) and the presets' catalogs. Nothing here touches a model."""
