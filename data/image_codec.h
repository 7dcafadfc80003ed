// Image files to RGB pixels: JPEG through libjpeg-turbo's TurboJPEG API (grayscale, YCbCr and
// CMYK files; decoded at 1/2, 1/4 or 1/8 size in the DCT domain when the caller needs no more,
// as PIL's draft mode does) and PNG through libpng (grayscale, palette and alpha, 8 or 16 bits).
// The kind comes from the bytes, never the file name. Errors are IoError naming the file.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace replica::data {

struct RgbImage {
  int width = 0, height = 0;
  int full_width = 0, full_height = 0;  // the file's size before any DCT-domain scaling
  std::vector<uint8_t> pixels;          // height x width x 3
};

enum class ImageKind { jpeg, png, unknown };
ImageKind sniff_image(std::string_view bytes);

// Decodes `bytes` (named `source` in errors). A JPEG is decoded at the smallest DCT scale whose
// size is still at least min_width x min_height (0, 0: full size).
RgbImage decode_image(std::string_view bytes, const std::string& source, int min_width = 0, int min_height = 0);
// The file's size without decoding it.
void image_size(std::string_view bytes, const std::string& source, int& width, int& height);

// Baseline JPEG of an RGB image (4:2:0 chroma, like PIL's default), for packing and tests.
std::string encode_jpeg(const uint8_t* rgb, int width, int height, int quality);
// For tests: a grayscale or a CMYK (Adobe, inverted, as Photoshop writes them) JPEG.
std::string encode_jpeg_gray(const uint8_t* gray, int width, int height, int quality);
std::string encode_jpeg_cmyk(const uint8_t* cmyk, int width, int height, int quality);
// 8-bit PNG of 1 (gray), 2 (gray+alpha), 3 (RGB) or 4 (RGBA) channels, for tests and tools.
std::string encode_png(const uint8_t* pixels, int width, int height, int channels);

}  // namespace replica::data
