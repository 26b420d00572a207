/* Region decoding of JPEGs with libjpeg-turbo, for dlojz_lib/data/transforms.py (loaded through ctypes).
 *
 * A RandomResizedCrop keeps on average about half of an image. Decoding the whole file and throwing the rest away
 * is what the reference pipeline does; libjpeg-turbo can do less:
 *   - jpeg_skip_scanlines() skips the inverse DCT, upsampling and colour conversion of the rows above the crop
 *     (their entropy-coded data must still be read, it is sequential);
 *   - jpeg_crop_scanline() restricts those stages to the crop's columns (widened to whole iMCUs);
 *   - the rows below the crop are not read at all: decoding stops after the crop's last row;
 *   - scale_num/scale_denom = 1/2, 1/4 or 1/8 downscales in the DCT domain when the crop will be shrunk anyway.
 * Pixels are those of a full decode with the same settings (libjpeg's defaults, as PIL uses them): the accurate
 * integer IDCT and fancy upsampling.
 *
 * Build: cc -O2 -shared -fPIC dlojz_lib/data/jpeg.c -ljpeg -o libdlojz_jpeg.so (dlojz_lib/data/transforms.py does it once, into the
 * user's cache, when a C compiler and libjpeg's headers are there; otherwise it decodes with simplejpeg or PIL).
 */
#include <setjmp.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>
#include <jerror.h>

#define DLOJZ_OK 0
#define DLOJZ_ERROR 1       /* corrupt or truncated data: the message says why */
#define DLOJZ_UNSUPPORTED 2 /* e.g. CMYK: the caller decodes it another way */

struct error_manager {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char *message;
    int message_size;
};

static void set_message(char *message, int message_size, const char *text) {
    if (message_size > 0) {
        strncpy(message, text, (size_t)message_size - 1);
        message[message_size - 1] = '\0';
    }
}

static void raise_error(j_common_ptr cinfo) {
    struct error_manager *err = (struct error_manager *)cinfo->err;
    char buffer[JMSG_LENGTH_MAX];
    (*cinfo->err->format_message)(cinfo, buffer);
    set_message(err->message, err->message_size, buffer);
    longjmp(err->jump, 1);
}

/* Corrupt-data warnings (e.g. extraneous bytes before a marker) are tolerated silently, as PIL does; data that ends
 * before the pixels we need is an error, as PIL reports a truncated file. */
static void on_message(j_common_ptr cinfo, int level) {
    if (level < 0 && cinfo->err->msg_code == JWRN_JPEG_EOF) {
        raise_error(cinfo);
    }
}

/* Errors longjmp to the caller's setjmp(err->jump) with their text in `message` (setjmp must stay in the caller:
 * its frame is the one still alive when libjpeg fails). */
static void use_error_manager(struct jpeg_decompress_struct *cinfo, struct error_manager *err, char *message,
                              int message_size) {
    cinfo->err = jpeg_std_error(&err->pub);
    err->pub.error_exit = raise_error;
    err->pub.emit_message = on_message;
    err->message = message;
    err->message_size = message_size;
}

static int rgb_decodable(const struct jpeg_decompress_struct *cinfo) {
    return cinfo->jpeg_color_space == JCS_YCbCr || cinfo->jpeg_color_space == JCS_RGB ||
           cinfo->jpeg_color_space == JCS_GRAYSCALE;
}

/* Size and colour space of a JPEG: width, height, and 1 if it can be decoded to RGB here (YCbCr, RGB, grayscale),
 * 0 otherwise (CMYK, YCCK, ...). */
int dlojz_jpeg_info(const unsigned char *data, unsigned long size, int *width, int *height, int *rgb_capable,
                    char *message, int message_size) {
    struct jpeg_decompress_struct cinfo;
    struct error_manager err;
    use_error_manager(&cinfo, &err, message, message_size);
    if (setjmp(err.jump)) {
        jpeg_destroy_decompress(&cinfo);
        return DLOJZ_ERROR;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, data, size);
    jpeg_read_header(&cinfo, TRUE);
    *width = (int)cinfo.image_width;
    *height = (int)cinfo.image_height;
    *rgb_capable = rgb_decodable(&cinfo);
    jpeg_destroy_decompress(&cinfo);
    return DLOJZ_OK;
}

/* Decode rows [top, top + rows) and at least columns [left, left + columns) of the image scaled by 1/scale_denom
 * (1, 2, 4 or 8; the scaled size is ceil(size / scale_denom), as libjpeg computes it) into `out`, RGB, one row
 * every `out_stride` bytes, `out_capacity` bytes in all.
 * libjpeg widens the column range to whole iMCUs: the decoded columns are [*decoded_left, *decoded_left +
 * *decoded_columns) and *decoded_left <= left. Returns DLOJZ_OK, DLOJZ_ERROR or DLOJZ_UNSUPPORTED. */
int dlojz_jpeg_decode_region(const unsigned char *data, unsigned long size, int scale_denom, int left, int top,
                             int columns, int rows, unsigned char *out, long out_stride, long out_capacity,
                             int *decoded_left, int *decoded_columns, char *message, int message_size) {
    struct jpeg_decompress_struct cinfo;
    struct error_manager err;
    JSAMPROW row_pointers[16];
    use_error_manager(&cinfo, &err, message, message_size);
    if (setjmp(err.jump)) {
        jpeg_destroy_decompress(&cinfo);
        return DLOJZ_ERROR;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, data, size);
    jpeg_read_header(&cinfo, TRUE);
    if (!rgb_decodable(&cinfo)) {
        set_message(message, message_size, "colour space not decodable to RGB here");
        jpeg_destroy_decompress(&cinfo);
        return DLOJZ_UNSUPPORTED;
    }
    cinfo.out_color_space = JCS_RGB;
    cinfo.scale_num = 1;
    cinfo.scale_denom = (unsigned int)scale_denom;
    jpeg_start_decompress(&cinfo);
    if (left < 0 || top < 0 || columns <= 0 || rows <= 0 || (JDIMENSION)(left + columns) > cinfo.output_width ||
        (JDIMENSION)(top + rows) > cinfo.output_height) {
        set_message(message, message_size, "region outside the scaled image");
        jpeg_destroy_decompress(&cinfo);
        return DLOJZ_ERROR;
    }
    JDIMENSION crop_left = (JDIMENSION)left, crop_columns = (JDIMENSION)columns;
    if (crop_columns < cinfo.output_width) {
        jpeg_crop_scanline(&cinfo, &crop_left, &crop_columns);
    }
    if ((long)crop_columns * 3 > out_stride || (long)(rows - 1) * out_stride + (long)crop_columns * 3 > out_capacity) {
        set_message(message, message_size, "output buffer too small");
        jpeg_destroy_decompress(&cinfo);
        return DLOJZ_ERROR;
    }
    if (top > 0 && jpeg_skip_scanlines(&cinfo, (JDIMENSION)top) != (JDIMENSION)top) {
        set_message(message, message_size, "could not skip to the region");
        jpeg_destroy_decompress(&cinfo);
        return DLOJZ_ERROR;
    }
    int done = 0;
    while (done < rows) {
        int batch = rows - done < 16 ? rows - done : 16;
        for (int i = 0; i < batch; i++) {
            row_pointers[i] = out + (long)(done + i) * out_stride;
        }
        JDIMENSION got = jpeg_read_scanlines(&cinfo, row_pointers, (JDIMENSION)batch);
        if (got == 0) {
            set_message(message, message_size, "no more scanlines");
            jpeg_destroy_decompress(&cinfo);
            return DLOJZ_ERROR;
        }
        done += (int)got;
    }
    *decoded_left = (int)crop_left;
    *decoded_columns = (int)crop_columns;
    /* The rows below the region are never decoded: abort instead of finishing. */
    jpeg_destroy_decompress(&cinfo);
    return DLOJZ_OK;
}
