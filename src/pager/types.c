/*
 * types.c: constructors for borrowed tensor views (kvpager/types.h), and the
 * running library's version (kvpager/version.h).
 * Pure functions; no state. Callers: anyone.
 */
#include "kvpager/types.h"

#include <string.h>

#include "pager/error.h"

kvp_tensor kvp_tensor4(const double *data, size_t d0, size_t d1, size_t d2, size_t d3)
{
    kvp_tensor view = {data, kvpi_shape4(d0, d1, d2, d3)};
    return view;
}

kvp_tensor kvp_tensor3(const double *data, size_t d0, size_t d1, size_t d2)
{
    kvp_tensor view = {data, kvpi_shape4(d0, d1, d2, 0)};
    view.shape.rank = 3;
    view.shape.dims[3] = 0;
    return view;
}

const char *kvp_version(void)
{
    return KVP_VERSION_STRING;
}

long kvp_version_number(void)
{
    return KVP_VERSION_NUMBER;
}
