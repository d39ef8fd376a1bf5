/*
 * src/python/module.c: the _kvpager extension module's entry point.
 *
 * Owns: PyInit__kvpager: readies the types (Pool, Cache, View, Model,
 * Sequence, Decoder, Scheduler, Layer, Ticket, Tier, HostTier, RedisTier), the module's functions
 * (group.c), the kvpager.Error hierarchy (errors.c) and the module
 * constants (the library's version, the dtypes). The pure-Python package
 * kvpager/__init__.py re-exports all of it.
 * Callers: the Python import system.
 */
#include "py_internal.h"

static struct PyModuleDef kvpager_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_kvpager",
    .m_doc = "kvpager's C extension: pools, caches, page views, models and sequences over "
             "libkvpager's public API. Import the kvpager package instead.",
    .m_size = -1,
    .m_methods = kvp_py_group_functions,
};

PyMODINIT_FUNC PyInit__kvpager(void);
PyMODINIT_FUNC PyInit__kvpager(void)
{
    PyTypeObject *types[] = {&KvpPyPool_Type, &KvpPyCache_Type, &KvpPyView_Type,
                             &KvpPyModel_Type, &KvpPySequence_Type, &KvpPyDecoder_Type,
                             &KvpPyScheduler_Type, &KvpPyLayer_Type, &KvpPyTicket_Type,
                             &KvpPyTier_Type, &KvpPyHostTier_Type, &KvpPyRedisTier_Type};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        if (PyType_Ready(types[i]) < 0)
            return NULL;
    PyObject *m = PyModule_Create(&kvpager_module);
    if (!m)
        return NULL;
    static const char *names[] = {"Pool",     "Cache",   "View",     "Model",
                                  "Sequence", "Decoder", "Scheduler", "Layer", "Ticket", "Tier",
                                  "HostTier", "RedisTier"};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        if (PyModule_AddObjectRef(m, names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    if (kvp_py_errors_init(m) < 0 ||
        PyModule_AddStringConstant(m, "library_version", kvp_version()) < 0 ||
        PyModule_AddStringConstant(m, "__version__", KVP_VERSION_STRING) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
